"""LoRA's up-projection weight gradient as ``(h^T dY)^T``: the gradients of every adapter equal ``nn.Linear``'s (float32,
under bf16 autocast, compiled), ``standard`` puts ``nn.Linear`` back, ``auto`` is decided by timing the widest
adapter at the run's tokens and dtype, and a resumed run keeps its checkpoint's choice without timing again."""
from __future__ import annotations

import copy
import functools

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lit_speed.finetune.adapter_grad import TransposedUpLinear, choose_up_grad, set_up_grad, up_projections
from lit_speed.finetune.adapters import add_adapters
from lit_speed.finetune.peft_callback import PEFTAdapters
from lit_speed.models.gpt import GPTModule
from lit_speed.run.runner import train
from lit_speed.tuning import Decision

SIZES = {"vocab_size": 97, "block_size": 16, "n_layer": 3, "n_head": 2, "n_embd": 32, "bias": True}


def _lora_gpt() -> GPTModule:
    torch.manual_seed(0)
    model = GPTModule(**SIZES)
    add_adapters(model, "lora", ["all-linear"], r=4, options={"init_lora_weights": False})  # B != 0: A gets gradients
    return model


def _grads(model: GPTModule, autocast: bool = False) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    x = torch.randint(0, 97, (4, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model.batch_loss((x, torch.roll(x, -1, 1)))
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return dict(zip([n for n, _ in trainable], torch.autograd.grad(loss, [p for _, p in trainable])))


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_every_adapter_gradient_equals_nn_linears(autocast):
    standard = _lora_gpt()
    transposed = copy.deepcopy(standard)
    assert set_up_grad(transposed, "transposed") == len(up_projections(standard)) == 12  # qkv, proj, fc, fc2 x 3
    expected, got = _grads(standard, autocast), _grads(transposed, autocast)
    assert expected.keys() == got.keys() and any("lora_B" in n for n in got) and any("lora_A" in n for n in got)
    for name in expected:
        assert got[name].dtype == expected[name].dtype and got[name].shape == expected[name].shape
        assert expected[name].abs().sum() > 0, name  # a gradient that is there to compare
        tol = 2e-2 if autocast else 1e-5  # bf16: the same products rounded through a different summation order
        torch.testing.assert_close(got[name], expected[name], rtol=tol, atol=tol * 1e-2, msg=name)


@pytest.mark.slow  # compiles (aot_eager) twice: ~5-8 s
def test_compiled_layers_trace_it_once_for_every_layer_and_give_the_same_gradients():
    """One compiled graph serves every block, as with nn.Linear: a ``forward`` replaced per instance made torch.compile
    guard on each object and compile each layer again (at 24 layers the recompile limit left 16 of them eager)."""
    from torch._dynamo.utils import counters

    def graphs(mode):
        torch._dynamo.reset()
        counters.clear()
        model = _lora_gpt()
        set_up_grad(model, mode)
        for block in model.model.blocks:
            block.compile(backend="aot_eager")  # AOTAutograd traces forward and backward, as inductor's input
        for _ in range(2):
            got = _grads(model)
        return counters["stats"]["unique_graphs"], got

    standard, expected = graphs("standard")
    transposed, got = graphs("transposed")
    assert transposed == standard < 2 * SIZES["n_layer"]  # not one (or more) per block
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-7, msg=name)


def test_standard_puts_nn_linear_back_and_a_copy_keeps_the_class():
    model = _lora_gpt()
    keys = model.state_dict().keys()
    set_up_grad(model, "transposed")
    twin = copy.deepcopy(model)
    assert all(type(up) is TransposedUpLinear and isinstance(up, nn.Linear) for up in up_projections(twin))
    assert set_up_grad(model, "standard") == 12
    assert all(type(up) is nn.Linear for up in up_projections(model))
    assert model.state_dict().keys() == twin.state_dict().keys() == keys
    with pytest.raises(ValueError, match=r"set_up_grad\(mode='auto'\): one of standard, transposed"):
        set_up_grad(model, "auto")


def test_choose_times_the_widest_adapter_at_the_runs_tokens_and_keeps_standard_without_one():
    seen = {}

    def measure(name, key, candidates, default):
        seen.update(name=name, key=key, default=default, names=sorted(candidates))
        for run in candidates.values():
            run()  # both candidates run at this shape
        return Decision(name, "transposed", "injected")

    decision = choose_up_grad(_lora_gpt(), tokens=96, dtype=torch.bfloat16, measure=measure)
    assert decision.chosen == "transposed"
    assert seen == {"name": "peft.up_grad", "default": "standard", "names": ["standard", "transposed"],
                    "key": {"shape": [128, 4], "tokens": 96, "device": "cpu", "dtype": "torch.bfloat16"}}  # fc: 32->128

    def must_not_time(*_args, **_kwargs):
        raise AssertionError("nothing to time")

    torch.manual_seed(0)
    assert choose_up_grad(GPTModule(**SIZES), measure=must_not_time).chosen == "standard"


def test_bad_setting_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"PEFTAdapters\(up_grad='fast'\): one of auto, standard, transposed\. "
                                         r"Fix: up_grad=auto"):
        PEFTAdapters(up_grad="fast")


class _Loader(pl.LightningDataModule):
    batch_size, block_size = 4, 16

    def train_dataloader(self):
        torch.manual_seed(2)
        x = torch.randint(0, 97, (16, 16))
        return torch.utils.data.DataLoader(list(zip(x, torch.roll(x, -1, 1))), batch_size=self.batch_size)


def test_auto_decides_at_fit_start_and_a_resumed_callback_keeps_the_choice(monkeypatch, tmp_path):
    calls = []

    def chosen(model, device, tokens, dtype):
        calls.append((str(device), tokens, dtype))
        return Decision("peft.up_grad", "transposed", "timed (stub)")

    monkeypatch.setattr("lit_speed.finetune.peft_callback.choose_up_grad", chosen)
    torch.manual_seed(0)
    model = GPTModule(**SIZES, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    callback = PEFTAdapters(export=False)
    trainer = pl.Trainer(max_steps=2, callbacks=[callback], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, datamodule=_Loader())
    assert calls == [("cpu", 64, torch.float32)]  # batch_size x block_size of the DataModule, the run's dtype
    assert all(type(up) is TransposedUpLinear for up in up_projections(model))
    assert callback.state_dict()["up_grad"] == "transposed"
    assert callback.final_summary()["up_grad"] == "transposed"

    def must_not_time(*_args):
        raise AssertionError("a resumed run keeps its checkpoint's choice")

    monkeypatch.setattr("lit_speed.finetune.peft_callback.choose_up_grad", must_not_time)
    resumed = PEFTAdapters(export=False)
    resumed.load_state_dict(callback.state_dict())
    torch.manual_seed(0)
    model = GPTModule(**SIZES, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    trainer = pl.Trainer(max_steps=1, callbacks=[resumed], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, datamodule=_Loader())
    assert resumed.chosen_up_grad == "transposed" and resumed.up_grad_reason == "restored from the checkpoint"
    assert all(type(up) is TransposedUpLinear for up in up_projections(model))
    explicit = PEFTAdapters(export=False, up_grad="standard")  # a setting given on resume is not overridden
    explicit.load_state_dict(callback.state_dict())
    assert explicit.chosen_up_grad is None  # decided at fit start: "requested"


def test_through_the_runner_the_choice_is_in_the_summary_and_the_start_up_table(make_cfg):
    summary = train(make_cfg(["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1",
                              "logger=none", "validate=false", "trainer.enable_progress_bar=false",
                              "trainer.enable_model_summary=false", "peft=lora", "peft.export=false",
                              "peft.up_grad=transposed"]))
    assert summary["components"]["PEFTAdapters"]["up_grad"] == "transposed"
    assert summary["startup"]["adapter gradients"] == "up-projections transposed"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")
def test_on_the_gpu_auto_times_both_and_the_gradients_are_nn_linears():
    model = _lora_gpt().cuda()
    decision = choose_up_grad(model, "cuda", tokens=2048)
    assert set(decision.times) == {"standard", "transposed"} and all(t and t > 0 for t in decision.times.values())
    twin = copy.deepcopy(model)
    set_up_grad(twin, "transposed")
    torch.manual_seed(1)
    x = torch.randint(0, 97, (4, 16), device="cuda")
    grads = []
    for m in (model, twin):
        loss = m.batch_loss((x, torch.roll(x, -1, 1)))
        grads.append(torch.autograd.grad(loss, [p for p in m.parameters() if p.requires_grad]))
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
