"""attention: scaled_dot_product_attention's kernel, named or timed on the first batch, applied, checkpointed, reused."""
from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lit_speed import GuardedPrecision
from lit_speed.models.gpt import GPT
from lit_speed.precision.attention_choice import AttentionChoice
from lit_speed.precision.step_timing import CountAttention, choose_attention
from lit_speed.tuning import Decision


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

    monkeypatch.setattr("lit_speed.precision.step_timing.choose_attention", stand_in)
    plugin = GuardedPrecision("bf16-mixed", attention="auto")
    assert plugin.describe()["attention"].startswith("auto: times this model's step")
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
