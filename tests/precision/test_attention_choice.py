"""attention: scaled_dot_product_attention's kernel, named or timed on the first batch, applied, checkpointed, reused."""
from __future__ import annotations

from contextlib import nullcontext

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lit_speed import GuardedPrecision
from lit_speed.models.gpt import GPT
from lit_speed.precision import attention_timing, step_timing
from lit_speed.precision.attention_choice import AttentionChoice
from lit_speed.precision.attention_timing import CountAttention, choose_attention
from lit_speed.tuning import Decision, machine_cache


def test_a_bad_attention_setting_is_refused_naming_it_and_the_fix():
    with pytest.raises(ValueError, match=r"^GuardedPrecision\(attention='fast'\): one of auto, math, flash, efficient, "
                                         r"cudnn or None \(torch's pick\)\. Fix: attention=auto"):
        GuardedPrecision(attention="fast")
    with pytest.raises(ValueError, match=r"GuardedPrecision\(attention='cudnn'\): the cudnn kernel is CUDA-only; this "
                                         r"run trains on the CPU\. Fix: attention=math or flash"):
        AttentionChoice("cudnn").check_device("cpu")
    AttentionChoice("flash").check_device("cpu")


def _grad_fn_of_attention(choice: AttentionChoice) -> str:
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    with choice.context():
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    return type(out.grad_fn).__name__


def test_a_named_kernel_is_the_one_the_forward_and_so_the_backward_run():
    assert "Flash" in _grad_fn_of_attention(AttentionChoice("flash"))
    assert "Flash" not in _grad_fn_of_attention(AttentionChoice("math"))
    assert "Flash" in _grad_fn_of_attention(AttentionChoice(None))  # torch's pick on a CPU: its flash kernel


def test_the_attention_of_a_step_is_counted_call_by_call():
    model = GPT(97, 16, n_layer=3, n_head=4, n_embd=32)
    with CountAttention() as seen:
        model(torch.randint(0, 97, (2, 16))).sum().backward()
    assert seen.calls == 3 and seen.scores == 3 * 2 * 4 * 16 * 16
    assert seen.math_saved_bytes() == 8 * seen.scores


class LinearLoss(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.net(x).square().mean()


class TinyGPT(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = GPT(97, 16, n_layer=2, n_head=2, n_embd=32)
        self.flash_enabled: list[bool] = []

    def training_step(self, batch, batch_idx):
        self.flash_enabled.append(torch.backends.cuda.flash_sdp_enabled())  # sdpa_kernel's flag, CPU kernels too
        x, y = batch
        return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        x = torch.randint(0, 97, (16, 16), generator=gen)
        return DataLoader(TensorDataset(x, torch.roll(x, -1, 1)), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_choose_attention_times_the_real_step_and_leaves_no_trace():
    module = TinyGPT()
    before = [p.detach().clone() for p in module.parameters()]
    batch = next(iter(module.train_dataloader()))
    rng = torch.get_rng_state()
    decision = choose_attention(module, batch, "32-true")
    assert decision.chosen in {"default", "math"} and set(decision.times) == {"default", "math"}
    assert all(t is not None and t > 0 for t in decision.times.values())
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))
    assert torch.equal(rng, torch.get_rng_state())
    assert torch.backends.cuda.flash_sdp_enabled()  # the math kernel's timing left torch's flags as they were
    refused = choose_attention(module, batch, "32-true", cap=1024)
    assert refused.chosen == "default" and refused.times == {}
    assert "the math kernel would keep" in refused.reason and "not timed" in refused.reason
    no_attention = choose_attention(LinearLoss(), torch.randn(2, 4), "32-true")
    assert no_attention.chosen == "default" and "calls no scaled_dot_product_attention" in no_attention.reason


class FlashFlags(torch.overrides.TorchFunctionMode):
    """Records, per scaled_dot_product_attention call, whether sdpa_kernel left torch's flash kernel enabled."""

    def __init__(self) -> None:
        super().__init__()
        self.flash: list[bool] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            self.flash.append(torch.backends.cuda.flash_sdp_enabled())
        return func(*args, **(kwargs or {}))


def test_auto_times_the_step_s_attention_calls_not_whole_steps(monkeypatch, tmp_path):
    """The kernels differ only in the attention: one recorded call, forward and backward with each kernel, times the
    step's calls; no whole training step is timed (the model runs once, a forward without gradients)."""
    monkeypatch.setenv("LIT_SPEED_CACHE_DIR", str(tmp_path))  # timed here, not read from another test's cache
    monkeypatch.setattr(attention_timing.ModeRun, "step", lambda *a: pytest.fail("a whole step was timed"))
    module = TinyGPT()  # two blocks: two attention calls of the same shape
    batch = next(iter(module.train_dataloader()))
    with FlashFlags() as seen:
        decision = choose_attention(module, batch, "32-true")
    assert decision.reason.startswith("timed here, the step's 2 attention calls (forward and backward): default ")
    assert set(decision.times) == {"default", "math"} and all(t > 0 for t in decision.times.values())
    assert seen.flash[:2] == [True, True]  # the model's own forward (a copy's), torch's pick
    timed = seen.flash[2:]  # the recorded call, run again: both kernels, interleaved, warm-up first
    assert timed[:2] == [True, False] and timed.count(True) == timed.count(False) >= 3
    assert module.flash_enabled == []  # counted on a copy


def test_a_call_replays_its_own_inputs_with_gradients_and_leaves_none_behind():
    q = torch.randn(2, 4, 16, 8)
    call = attention_timing.AttentionCall(((q, q.clone(), q.clone()), {"is_causal": True}), nullcontext)
    call.run("math")
    assert all(a.requires_grad and a.grad is None for a in call.args) and call.grad.shape == q.shape
    assert torch.equal(call.args[0], q)


class TwoLengths(torch.nn.Module):
    """Attention over the whole window and over its first half: calls of different shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))

    def forward(self, x):
        h = (x * self.w).unsqueeze(1).repeat(1, 2, 1, 1)
        full = F.scaled_dot_product_attention(h, h, h, is_causal=True)
        half = F.scaled_dot_product_attention(h[:, :, :4], h[:, :, :4], h[:, :, :4])
        return full.square().mean() + half.square().mean()


def test_calls_of_different_shapes_are_timed_as_whole_steps(monkeypatch, tmp_path):
    monkeypatch.setenv("LIT_SPEED_CACHE_DIR", str(tmp_path))
    decision = choose_attention(TwoLengths(), torch.randn(2, 8, 4), "32-true")
    assert decision.reason.startswith("timed here, whole steps (the calls differ): default ")


def _fit(root, plugin, max_steps, module, ckpt_path=None):
    trainer = pl.Trainer(max_steps=max_steps, plugins=[plugin], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root,
                         callbacks=[ModelCheckpoint(dirpath=root, save_last=True)])
    trainer.fit(module, ckpt_path=ckpt_path)


def test_auto_is_decided_on_the_first_batch_in_the_run_s_mode_applied_saved_and_reused_on_resume(tmp_path,
                                                                                                  monkeypatch):
    calls = []

    def stand_in(module, batch, mode, device=None):  # the timing itself is tested above, for real
        calls.append(mode)
        return Decision("precision.attention", "math", "stand-in timing")

    monkeypatch.setattr("lit_speed.precision.attention_timing.choose_attention", stand_in)
    plugin = GuardedPrecision("bf16-mixed", attention="auto")
    assert plugin.describe()["attention"].startswith("auto: times this model's attention")
    module = TinyGPT()
    _fit(tmp_path, plugin, 2, module)
    assert calls == ["bf16-mixed"] and module.flash_enabled == [False, False]
    assert torch.backends.cuda.flash_sdp_enabled()  # only inside the forwards
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)["GuardedPrecision"]
    assert saved["attention"] == "math" and saved["attention_reason"] == "stand-in timing"
    assert plugin.final_summary()["attention"] == "math"

    resumed, module = GuardedPrecision("bf16-mixed", attention="auto"), TinyGPT()
    _fit(tmp_path, resumed, 4, module, ckpt_path=str(tmp_path / "last.ckpt"))
    assert calls == ["bf16-mixed"], "timed again on resume"
    assert module.flash_enabled == [False, False] and "restored from the checkpoint" in resumed.attention.reason


def test_without_the_setting_torch_picks_and_nothing_is_saved(tmp_path):
    plugin = GuardedPrecision("32-true")
    module = TinyGPT()
    _fit(tmp_path, plugin, 2, module)
    assert module.flash_enabled == [True, True] and "attention" not in plugin.describe()
    assert "attention" not in torch.load(tmp_path / "last.ckpt", weights_only=True)["GuardedPrecision"]


# ---- precision=auto and attention=auto: each mode with its faster kernel, timed together, once ------------------------------

MODES = ("32-true", "bf16-master", "bf16-mixed")


def _kernel_per_mode(winners: dict[str, str], calls: list[str]):
    """A stand-in for choose_attention: ``winners[mode]`` wins in that mode (the timing itself is tested above)."""
    def choose(module, batch, mode, device=None):
        calls.append(mode)
        kernel = winners.get(mode, "default")
        return Decision("precision.attention", kernel, f"stand-in: {kernel} in {mode}", {"default": 2.0, "math": 1.0})
    return choose


def test_each_mode_is_a_candidate_with_its_own_faster_kernel(monkeypatch):
    module = TinyGPT()
    batch = next(iter(module.train_dataloader()))
    calls: list[str] = []
    monkeypatch.setattr(attention_timing, "choose_attention",
                        _kernel_per_mode({"bf16-master": "math", "bf16-mixed": "math"}, calls))
    choice = AttentionChoice("auto")
    assert choice.with_modes(module, batch, MODES, None) == ["32-true", "bf16-master+math", "bf16-mixed+math"]
    assert calls == list(MODES) and choice.per_mode_line().startswith("; 32-true's attention: default (stand-in")
    assert AttentionChoice("math").with_modes(module, batch, MODES, None) == list(MODES)  # named: nothing to time
    not_timed = Decision("precision.attention", "default", "calls no scaled_dot_product_attention: not timed")
    monkeypatch.setattr(attention_timing, "choose_attention", lambda *a, **k: not_timed)
    assert choice.with_modes(module, batch, MODES, None) == list(MODES) and choice.per_mode_line() == ""
    monkeypatch.setattr(attention_timing, "choose_attention", lambda *a, **k: 1 / 0)
    assert choice.with_modes(module, batch, MODES, None) == list(MODES) and choice.pending  # decided alone later


def test_each_mode_s_calls_are_timed_for_real_on_copies():
    module = TinyGPT()
    batch = next(iter(module.train_dataloader()))
    rng = torch.get_rng_state()
    names = AttentionChoice("auto").with_modes(module, batch, MODES, None)
    assert [n.partition("+")[0] for n in names] == list(MODES) and {n.partition("+")[2] for n in names} <= {"", "math"}
    assert torch.equal(rng, torch.get_rng_state()) and module.flash_enabled == []


@pytest.mark.parametrize("name", ["bf16-mixed", "bf16-mixed+math"])
def test_a_math_candidate_s_step_runs_the_math_kernel_in_its_mode(name):
    module = TinyGPT()
    run = step_timing.ModeRun(module, name, step_timing.loss_of)
    run.step(next(iter(module.train_dataloader())))
    assert run.model.flash_enabled == [not name.endswith("+math")]
    assert torch.backends.cuda.flash_sdp_enabled()  # only inside the step


@pytest.mark.parametrize(("winner", "mode", "kernel"), [("bf16-master+math", "bf16-master", "math"),
                                                        ("bf16-mixed", "bf16-mixed", "default")])
def test_auto_precision_and_auto_attention_are_decided_by_one_timing_applied_and_saved(
        tmp_path, monkeypatch, winner, mode, kernel):
    """Both ``auto``: each mode's calls timed once, then one interleaved timing of the modes, each with its faster
    kernel, decides both; the kernel is not timed again on its own, the run trains in the pair, and the checkpoint
    holds both (a resume keeps them, tested above)."""
    monkeypatch.setenv("LIT_SPEED_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(machine_cache, "_IN_PROCESS", {})
    monkeypatch.setattr("lit_speed.precision.guarded_precision.cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr("lit_speed.precision.guarded_precision.measure_slowdown", lambda dtype: 0.5)
    timed: list[tuple[str, ...]] = []

    def sample(base, batch, names, steps, budget_s, loss_fn):
        timed.append(tuple(names))
        return {n: [0.001 if n == winner else 0.002] * 3 for n in names}

    monkeypatch.setattr(step_timing, "_sample_interleaved", sample)
    calls: list[str] = []
    monkeypatch.setattr(attention_timing, "choose_attention", _kernel_per_mode({"bf16-master": "math"}, calls))
    plugin, module = GuardedPrecision("auto", attention="auto"), TinyGPT()
    _fit(tmp_path, plugin, 2, module)
    assert timed == [("32-true", "bf16-master+math", "bf16-mixed")] and calls == list(MODES)
    assert (plugin.mode, plugin.attention.chosen) == (mode, kernel)
    assert plugin.attention.reason.startswith("timed together with the precision modes: timed this model's step")
    assert f"{winner} 1.0 ms" in plugin.reason and "; bf16-master's attention: math (stand-in" in plugin.reason
    assert module.flash_enabled == [kernel == "default"] * 2
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)["GuardedPrecision"]
    assert saved["attention"] == kernel
