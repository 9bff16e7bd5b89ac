"""ActivationCheckpointing: same gradients, less activation memory, unchanged state_dict, clear errors."""
from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch

from lit_speed.memory.activation_checkpointing import ActivationCheckpointing, checkpoint_modules, restore_modules
from lit_speed.memory.memory_tracker import LiveTensorTracker
from lit_speed.models.gpt import GPT, Block, GPTModule
from tests.helpers.memory import TINY_GPT, adamw, charlm_datamodule


def _grads_and_peak(model: torch.nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], int]:
    model.zero_grad(set_to_none=True)
    with LiveTensorTracker() as tracker:
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), x.view(-1)).backward()
    return [p.grad.clone() for p in model.parameters()], tracker.peak_bytes


@pytest.fixture
def gpt_and_batch():
    torch.manual_seed(0)
    cfg = {k: v for k, v in TINY_GPT.items()}
    return GPT(**cfg), torch.randint(0, 97, (12, 64))


@pytest.mark.parametrize("offload", [False, True])
def test_same_gradients_and_lower_activation_peak(gpt_and_batch, offload):
    model, x = gpt_and_batch
    plain_grads, plain_peak = _grads_and_peak(model, x)
    wrapped = checkpoint_modules(model, ["Block"], offload=offload)
    assert wrapped == [f"blocks.{i}" for i in range(TINY_GPT["n_layer"])]
    grads, peak = _grads_and_peak(model, x)
    # fp32, tolerance 1e-6: recomputation runs the same ops in the same order, so results are bitwise equal here
    for a, b in zip(plain_grads, grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # the live-tensor peak covers forward, backward and the recompute inside backward
    assert peak < plain_peak
    restore_modules(model)
    assert _grads_and_peak(model, x)[1] == plain_peak


def test_state_dict_keys_unchanged_and_deepcopy_points_at_copy(gpt_and_batch):
    model, x = gpt_and_batch
    keys = list(model.state_dict())
    checkpoint_modules(model, [Block])
    assert list(model.state_dict()) == keys
    clone = copy.deepcopy(model)
    assert clone.blocks[0].forward.module is clone.blocks[0]
    with torch.no_grad():
        torch.testing.assert_close(clone(x), model(x), rtol=0, atol=0)
    assert restore_modules(model) == TINY_GPT["n_layer"]
    assert "forward" not in vars(model.blocks[0])


def test_dotted_import_path(gpt_and_batch):
    model, _ = gpt_and_batch
    assert len(checkpoint_modules(model, ["lit_speed.models.gpt.Block"])) == TINY_GPT["n_layer"]


def test_errors_name_the_setting(gpt_and_batch):
    model, _ = gpt_and_batch
    with pytest.raises(ValueError, match=r"ActivationCheckpointing\(modules=\[\]\): modules must be a non-empty "
                                         r"list.*got \[\]"):
        ActivationCheckpointing(modules=[])
    with pytest.raises(ValueError, match=r"no submodule of type 'Blok' in GPT\. Types present: .*Block"):
        checkpoint_modules(model, ["Blok"])
    with pytest.raises(ValueError, match=r"cannot import 'lit_speed.models.gpt.Nope'"):
        checkpoint_modules(model, ["lit_speed.models.gpt.Nope"])
    with pytest.raises(ValueError, match="matched no submodule"):
        checkpoint_modules(model.blocks[0], [Block])  # the root itself is never wrapped
    with pytest.raises(ValueError, match=r"checkpoint_modules\(types=\[\]\): types is empty"):
        checkpoint_modules(model, [])


def test_trainer_run_checkpoint_loads_into_plain_model(tmp_path):
    torch.manual_seed(0)
    model = GPTModule(**TINY_GPT, optimizer=adamw)
    callback = ActivationCheckpointing(modules=["Block"])
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, limit_val_batches=0, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback], default_root_dir=tmp_path)
    trainer.fit(model, datamodule=charlm_datamodule(4))
    assert len(callback.wrapped) == TINY_GPT["n_layer"]
    assert callback.describe()["activation checkpointing"].startswith("Block (4 wrapped)")
    assert not any("forward" in vars(m) for m in model.modules())  # teardown restored the model
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    plain = GPTModule(**TINY_GPT)
    plain.load_state_dict(torch.load(path, weights_only=False)["state_dict"], strict=True)
    x = torch.randint(0, 97, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(plain(x), model(x), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="offload only lowers device memory when the device is a GPU")
def test_offload_lowers_cuda_memory():
    torch.manual_seed(0)
    model, x = GPT(**TINY_GPT).cuda(), torch.randint(0, 97, (32, 64), device="cuda")
    peaks = []
    for offload in (False, True):
        checkpoint_modules(model, ["Block"], offload=offload)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model(x).float().mean().backward()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        model.zero_grad(set_to_none=True)
        restore_modules(model)
    assert peaks[1] < peaks[0]


@pytest.mark.slow  # compiles (aot_eager) twice: ~5-8 s
def test_compiled_checkpointed_blocks_share_one_graph(gpt_and_batch):
    """Compiled checkpointed blocks share their graphs as plain ones do: the per-instance ``forward`` object does not
    make torch.compile compile each block again (unlike the frozen base's and the LoRA up-projection's first
    versions, which did: tests/finetune)."""
    from torch._dynamo.utils import counters

    model, x = gpt_and_batch

    def graphs(checkpointed):
        torch._dynamo.reset()
        counters.clear()
        twin = copy.deepcopy(model)
        if checkpointed:
            checkpoint_modules(twin, [Block])
        for block in twin.blocks:
            block.compile(backend="aot_eager")
        for _ in range(2):
            twin(x).float().pow(2).mean().backward()
        return counters["stats"]["unique_graphs"]

    assert graphs(True) == graphs(False) < TINY_GPT["n_layer"]


def test_a_hugging_face_models_own_checkpointing_is_read_without_a_deprecation_warning():
    """transformers 5 renamed ``is_gradient_checkpointing`` to ``is_activation_checkpointing`` and keeps the old name
    as an alias that warns on each read: the 1B preset printed that FutureWarning at fit start."""
    import warnings

    transformers = pytest.importorskip("transformers")
    from lit_speed.memory.activation_checkpointing import activation_checkpointing_on

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert activation_checkpointing_on(model) is False
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert activation_checkpointing_on(model) is True
