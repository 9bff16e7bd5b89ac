"""A frozen base held in bf16 under adapters: half the frozen bytes, adapters/gradients/optimizer state float32, the
float32-compute path equal to a float32 model holding the same (bf16-rounded) values, the loss within bf16 rounding
of the float32 base, no float32 copy of the base kept for backward, a float32 export equal to merging by hand, the
compute dtype chosen by measurement, and the combinations that cannot keep float32 adapters refused."""
from __future__ import annotations

import copy
import math

import lightning.pytorch as pl
import pytest
import torch

from lit_speed.finetune.adapters import add_adapters, frozen_fingerprint
from lit_speed.finetune.base_dtype_choice import auto_base_dtype
from lit_speed.finetune.frozen_base import (
    choose_base_compute,
    frozen_base_bytes,
    lower_frozen_base,
    set_base_compute,
    unwrap_frozen_base,
)
from lit_speed.finetune.peft_callback import PEFTAdapters
from lit_speed.memory.memory_tracker import LiveTensorTracker
from lit_speed.models.gpt import GPTModule
from lit_speed.run.config_error import ConfigError
from lit_speed.run.memory_fit.fit_levers import configured_levers
from lit_speed.run.runner import train
from lit_speed.tuning import Decision, choose_fastest

SIZES = {"vocab_size": 97, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32, "bias": True}


def _lora_gpt(seed: int = 0) -> GPTModule:
    torch.manual_seed(seed)
    model = GPTModule(**SIZES)
    add_adapters(model, "lora", ["all-linear"], r=4, options={"init_lora_weights": False})  # B != 0: a real update
    return model


def _batch(seed: int = 1):
    torch.manual_seed(seed)
    x = torch.randint(0, 97, (4, 16))
    return x, torch.roll(x, -1, 1)


def _lora_grads(model: GPTModule):
    loss = model.batch_loss(_batch())
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return loss, dict(zip(names, torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])))


def test_only_frozen_matrices_are_lowered_once_and_the_declared_saving_is_what_happens():
    model = _lora_gpt()
    before, after = frozen_base_bytes(model)
    lowered = lower_frozen_base(model)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert all(d == torch.float32 for n, d in dtypes.items() if "lora_" in n)  # adapters stay float32
    assert dtypes["model.wte.weight"] == dtypes["model.blocks.0.attn.qkv.base_layer.weight"] == torch.bfloat16
    assert dtypes["model.ln_f.weight"] == dtypes["model.blocks.0.attn.qkv.base_layer.bias"] == torch.float32
    assert model.model.lm_head.weight is model.model.wte.weight  # still tied: one tensor, lowered once
    # wte(=lm_head) + wpe + 4 base Linear weights per block x 2 blocks
    assert lowered.tensors == 2 + 8 and lowered.saved_bytes == lowered.bytes_after == before - after == after
    assert frozen_base_bytes(model) == (after, after)  # nothing left to lower


def test_fp32_compute_equals_a_float32_model_holding_the_same_bf16_values():
    lowered = _lora_gpt()
    reference = copy.deepcopy(lowered)
    lower_frozen_base(lowered, compute="fp32")
    with torch.no_grad():  # the reference: float32 weights rounded to bf16 and back (what the lowered base holds)
        for p in reference.parameters():
            if not p.requires_grad and p.dim() >= 2:
                p.copy_(p.to(torch.bfloat16).float())
    loss, grads = _lora_grads(lowered)
    ref_loss, ref_grads = _lora_grads(reference)
    # the same float32 matmuls on the same values: float32 rounding only
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name, grad in grads.items():
        assert grad.dtype == torch.float32
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6)


def test_bf16_compute_and_the_float32_base_are_within_bf16_rounding():
    base_loss, base_grads = _lora_grads(_lora_gpt())
    for compute in ("fp32", "bf16"):
        model = _lora_gpt()
        lower_frozen_base(model, compute=compute)
        loss, grads = _lora_grads(model)
        # weights rounded to 8 mantissa bits (relative 2^-9), and bf16 matmuls for compute=bf16: ~1e-2 relative
        torch.testing.assert_close(loss, base_loss, rtol=1e-2, atol=1e-2)
        for name, grad in grads.items():
            scale = float(base_grads[name].abs().max())
            assert float((grad - base_grads[name]).abs().max()) <= 5e-2 * scale + 1e-4, name


def test_no_float32_copy_of_the_base_lives_through_forward_and_backward():
    torch.manual_seed(0)
    width = 512
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(6)])
    add_adapters(model, "lora", ["all-linear"], r=2)
    lower_frozen_base(model, compute="fp32")
    fp32_base = 6 * width * width * 4  # 6 MiB
    x = torch.randn(4, width)
    with LiveTensorTracker() as tracker:
        model(x).sum().backward()
    # one layer's transient float32 weight (1 MiB) at a time, plus small activations and adapter gradients
    assert tracker.peak_bytes < fp32_base / 3


def test_choose_base_compute_does_not_time_emulated_bf16_and_else_keeps_the_faster(monkeypatch):
    model = _lora_gpt()
    lower_frozen_base(model)

    def must_not_time(*args, **kwargs):
        raise AssertionError("bf16 was timed on a CPU without native bf16")

    monkeypatch.setattr("lit_speed.finetune.frozen_base.cpu_has_native_bf16", lambda: False)
    decision = choose_base_compute(model, measure=must_not_time)
    assert decision.chosen == "fp32" and "no native bf16 kernels" in decision.reason

    monkeypatch.setattr("lit_speed.finetune.frozen_base.cpu_has_native_bf16", lambda: True)
    for times, chosen in (({"fp32": 2.0, "bf16": 1.0}, "bf16"), ({"fp32": 1.0, "bf16": 0.99}, "fp32")):
        seen = {}

        def injected(name, key, candidates, default, times=times):  # the timer, injected: no wall clock
            for label, call in candidates.items():
                call()  # each candidate runs the largest lowered layer's forward and backward
            seen.update(key=key, default=default)
            return Decision(name, *choose_fastest(times, default), times=times)

        decision = choose_base_compute(model, measure=injected)
        assert decision.chosen == chosen
        assert seen == {"key": {"shape": [128, 32], "tokens": 256, "device": "cpu"}, "default": "fp32"}


def test_choose_base_compute_times_at_most_probe_weight_elements_of_the_largest_layer(monkeypatch):
    """A large vocabulary's head (1B dims: 128256 x 2048) is timed on its first rows: the whole of it made 2.1 GB of
    float32 probe tensors at fit start, the run's peak RSS."""
    from lit_speed.finetune import frozen_base

    model = _lora_gpt()
    lower_frozen_base(model)
    monkeypatch.setattr(frozen_base, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(frozen_base, "PROBE_WEIGHT_ELEMENTS", 32 * 20)  # the largest layer is 128 x 32
    shapes = []

    def injected(name, key, candidates, default):
        for call in candidates.values():
            call()
        shapes.append(key["shape"])
        return Decision(name, default, "injected", times={})

    with LiveTensorTracker() as tracker:
        choose_base_compute(model, tokens=4, measure=injected)
    assert shapes == [[20, 32]]
    assert tracker.peak_bytes < 128 * 32 * 4  # not even one float32 copy of the whole layer


def _fit(callback: PEFTAdapters, tmp_path, precision="32-true", steps=4, seed=0):
    torch.manual_seed(seed)
    module = GPTModule(**SIZES, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2))
    x = torch.randint(0, 97, (16, 16), generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(x, torch.roll(x, -1, 1))
    losses = []

    class Record(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            losses.append(float(trainer.callback_metrics["train/loss"]))
            grads = {n: p.grad.dtype for n, p in pl_module.named_parameters() if p.grad is not None}
            assert grads and set(grads.values()) == {torch.float32} and all("lora_" in n for n in grads)

    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, precision=precision,
                         callbacks=[callback, Record()], default_root_dir=tmp_path)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    return module, trainer, losses


def test_trains_fp32_adapters_over_a_bf16_base_and_exports_float32_equal_to_merging_by_hand(tmp_path):
    plain, _, plain_losses = _fit(PEFTAdapters(r=4, export=False), tmp_path / "plain")
    callback = PEFTAdapters(r=4, base_dtype="bf16", export=True, export_dir=str(tmp_path / "merged"))
    module, trainer, losses = _fit(callback, tmp_path / "bf16")
    assert callback.chosen_compute in ("fp32", "bf16") and callback.compute_reason
    assert callback.base_fingerprint == frozen_fingerprint(_lora_gpt_like(plain))  # the base as loaded
    assert module.model.wte.weight.dtype == torch.bfloat16
    state = trainer.optimizers[0].state
    assert state and {t.dtype for s in state.values() for k, t in s.items() if k != "step"} == {torch.float32}
    # the same steps over a base rounded to bf16: within bf16 rounding of the float32 base's losses
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_losses), rtol=1e-2, atol=1e-2)

    exported = torch.load(tmp_path / "merged" / "model.pt", weights_only=True)
    assert {v.dtype for v in exported.values() if v.is_floating_point()} == {torch.float32}
    modules = dict(module.named_modules())
    for layer in ("model.blocks.0.attn.qkv", "model.blocks.1.mlp.proj"):
        lora = modules[layer]
        by_hand = lora.base_layer.weight.float() + (lora.lora_B["default"].weight @ lora.lora_A["default"].weight) \
            * lora.scaling["default"]
        torch.testing.assert_close(exported[f"{layer}.weight"], by_hand.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("precision, held", [("bf16-mixed", torch.bfloat16), ("32-true", torch.float32)])
def test_auto_holds_the_base_in_bf16_only_where_autocast_casts_every_frozen_matmul_to_bf16(tmp_path, precision, held):
    callback = PEFTAdapters(r=4, base_dtype="auto", export=False)
    module, _, losses = _fit(callback, tmp_path, precision=precision, steps=2)
    assert module.model.wte.weight.dtype == held and all(map(math.isfinite, losses))
    assert callback.base_dtype == (None if held == torch.float32 else "bf16")
    assert callback.base_dtype_reason.startswith(f"auto: precision={precision} ")
    row = callback.describe()["frozen base"]
    assert row.startswith("held in bf16 (" if held == torch.bfloat16 else "as loaded (auto: ") and "auto: " in row


def test_auto_base_dtype_is_bf16_only_under_bf16_autocast_without_zero_and_with_adapters():
    assert auto_base_dtype("bf16-mixed")[0] == "bf16"
    for args in [("32-true",), ("16-mixed",), ("bf16-true",), ("bf16-master",), ("auto",), (None,),
                 ("bf16-mixed", True), ("bf16-mixed", False, "freeze")]:
        held, reason = auto_base_dtype(*args)
        assert held is None and reason, args


def test_the_fit_check_reads_auto_as_the_runner_decides_it(make_cfg):
    base = ["peft=lora", "logger=none"]
    assert configured_levers(make_cfg([*base, "precision=bf16-mixed"])).base_bf16
    assert not configured_levers(make_cfg([*base, "precision=32-true"])).base_bf16
    assert not configured_levers(make_cfg([*base, "precision=bf16-mixed", "peft.base_dtype=null"])).base_bf16
    # ZeRO partitions the parameters itself: auto keeps the base as loaded there (explicit bf16 is refused: test_bad_input)
    assert not configured_levers(make_cfg([*base, "precision=bf16-mixed", "strategy=zero2"])).base_bf16


def _lora_gpt_like(module: GPTModule) -> GPTModule:
    fresh = GPTModule(**SIZES)
    fresh.load_state_dict({k.replace(".base_layer", ""): v for k, v in module.state_dict().items() if "lora_" not in k})
    add_adapters(fresh, "lora", ["all-linear"], r=4)
    return fresh


def test_wrappers_come_off_and_compute_can_change():
    model = _lora_gpt()
    lower_frozen_base(model)
    assert set_base_compute(model, "bf16") == 11  # 10 tensors; wte and the tied lm_head are two modules
    assert unwrap_frozen_base(model) == 11 and not any("forward" in vars(m) for m in model.modules())
    assert {type(m) for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))} == {
        torch.nn.Linear, torch.nn.Embedding}  # the classes they had
    with pytest.raises(ValueError, match=r"set_base_compute\(compute='fp16'\): one of fp32, bf16"):
        set_base_compute(model, "fp16")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"base_dtype": "fp16"}, r"PEFTAdapters\(base_dtype='fp16'\): .*Fix: base_dtype=bf16"),
    ({"base_dtype": "bf16", "base_compute": "int8"}, r"PEFTAdapters\(base_compute='int8'\): one of auto, fp32, bf16"),
    ({"base_dtype": "bf16", "method": "freeze", "trainable_modules": ["last-linear"]},
     r"PEFTAdapters\(base_dtype='bf16'\): method=freeze has no adapters"),
])
def test_bad_settings_are_refused_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PEFTAdapters(**kwargs)


SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "logger=none",
         "validate=false", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]
# the refusals of precision modes and ZeRO through the runner: tests/run/test_bad_input.py (memory levers)


def test_through_the_runner_a_resume_keeps_the_compute_choice_and_another_base_dtype_is_refused(make_cfg, tmp_path):
    base = [*SHORT, "callbacks=model_checkpoint", "peft=lora", "peft.export=false"]
    summary = train(make_cfg([*base, "peft.base_dtype=bf16", "precision=bf16-mixed"]))
    assert summary["components"]["PEFTAdapters"]["base_compute"] == "bf16"  # autocast's dtype: not timed
    assert summary["startup"]["frozen base"].startswith("held in bf16 (")
    checkpoint = tmp_path / "checkpoints" / "last.ckpt"
    with pytest.raises(ConfigError, match=r"trained over a base held in bf16: resuming would not continue the same "
                                          r"run\. Fix: base_dtype=bf16"):
        train(make_cfg([*base, "peft.base_dtype=null", "precision=bf16-mixed", "trainer.max_epochs=2",
                        f"ckpt_path={checkpoint}"]))
    # the default, peft.base_dtype=auto, holds the base in bf16 under bf16-mixed: the same run continues
    summary = train(make_cfg([*base, "precision=bf16-mixed", "trainer.max_epochs=2", f"ckpt_path={checkpoint}"]))
    assert summary["global_step"] == 4 and summary["components"]["PEFTAdapters"]["base_compute"] == "bf16"
    assert summary["components"]["PEFTAdapters"]["base_dtype"] == "bf16"
    assert "auto: precision=bf16-mixed casts every frozen matmul" in summary["startup"]["frozen base"]


@pytest.mark.slow  # compiles (aot_eager) twice: ~5-8 s
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8], ids=["bf16", "int8"])
def test_compiled_blocks_share_one_graph_as_with_a_float32_base(dtype):
    """A lowered module's class, not a ``forward`` object per instance, carries the low-precision path: compiled
    blocks then share their graphs as a float32 base's do (per-instance objects made torch.compile guard on each one's
    identity and compile each block again, until its recompile limit left the rest eager)."""
    from torch._dynamo.utils import counters

    def graphs(lower):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = GPTModule(**{**SIZES, "n_layer": 3})
        add_adapters(model, "lora", ["all-linear"], r=4, options={"init_lora_weights": False})
        if lower:
            lower_frozen_base(model, dtype)
        for block in model.model.blocks:
            block.compile(backend="aot_eager")
        for _ in range(2):
            _lora_grads(model)
        return counters["stats"]["unique_graphs"]

    assert graphs(lower=True) == graphs(lower=False) < 6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_lowering_a_base_read_without_a_copy_lets_go_of_the_files_mapping(tmp_path, dtype):
    # transformers reads a float32 safetensors file into a float32 model as views of one mapping of the file; lowering
    # replaced the large weights, and the norms and biases it left kept the whole file mapped (its pages in the RSS)
    from transformers import AutoModelForCausalLM

    from lit_speed.finetune.frozen_base import _file_mapped_ranges
    from tests.helpers.tiny_hf import save_tiny_causal_lm

    folder = save_tiny_causal_lm(tmp_path / "qwen2", arch="qwen2", tokenizer=False)
    weights = str((folder / "model.safetensors").resolve())

    def file_is_mapped() -> bool:
        return any(line.rstrip().endswith(weights) for line in open("/proc/self/maps"))

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if not file_is_mapped():
        pytest.skip("this transformers copies what it reads: nothing of the file stays mapped to let go of")
    model.requires_grad_(False)
    norm = model.model.norm.weight.detach().clone()
    lower_frozen_base(model, dtype)
    ranges = _file_mapped_ranges()
    inside = [name for name, t in [*model.named_parameters(), *model.named_buffers()]
              if any(start <= t.data_ptr() < end for start, end in ranges)]
    assert inside == [] and not file_is_mapped()
    assert torch.equal(model.model.norm.weight, norm)  # copied, not changed


@pytest.mark.parametrize("precision, held", [("bf16-mixed", torch.bfloat16), ("32-true", torch.float32)])
def test_the_runner_reads_a_bf16_folder_as_auto_holds_it(make_cfg, tmp_path, precision, held):
    """peft.base_dtype=auto, decided before the weights load: model.load_dtype follows it (a bf16 folder read in bf16
    under bf16-mixed, no float32 copy of the base; read in float32 under 32-true), and PEFTAdapters holds the same."""
    import sysconfig
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from lit_speed.run.runner import build
    from tests.helpers.tiny_hf import save_tiny_causal_lm

    folder = save_tiny_causal_lm(tmp_path / "fp32", "qwen2", seed=3, max_positions=64)
    AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "bf16" / name).write_bytes((folder / name).read_bytes())
    texts = Path(sysconfig.get_paths()["stdlib"]) / "json"
    parts = build(make_cfg(["model=hf_causal_lm", "data=text_folder", f"model.pretrained={tmp_path / 'bf16'}",
                            f"data.root={texts}", "data.block_size=32", "peft=lora", f"precision={precision}",
                            "logger=none"]))
    model = parts["model"]
    assert bool(getattr(model, "loaded_low_precision", False)) == (held == torch.bfloat16)
    assert model.model.model.embed_tokens.weight.dtype == held
    adapters = next(cb for cb in parts["callbacks"] if isinstance(cb, PEFTAdapters))
    assert adapters.base_dtype == (None if held == torch.float32 else "bf16")
    row = adapters.describe().get("frozen base", "")
    assert ("read from the folder in bf16: nothing cast" in row) == (held == torch.bfloat16), row
