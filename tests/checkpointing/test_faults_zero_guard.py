"""The non-finite guard holds under ZeRO: a NaN loss or an inf gradient skips the engine's step and is counted.

Before, ``GuardedPrecision("bf16-mixed" | "32-true", on_nonfinite="skip")`` under ``ZeroStrategy`` only warned
that the policy "is not applied": DeepSpeed checks gradients for overflow in fp16 only, and a NaN loss with
finite gradients (``loss + nan``) is stepped on in every mode.
"""
from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from lit_speed.precision.guarded_precision import GuardedPrecision  # noqa: E402
from lit_speed.precision.zero_guard import GuardedDeepSpeedPrecision, poison_nonfinite_loss  # noqa: E402
from lit_speed.strategies.zero_strategy import ZeroStrategy  # noqa: E402

NAN_LOSS_STEP, INF_GRAD_STEP, STEPS = 1, 3, 5


class InfGradient(torch.autograd.Function):
    """Identity forward; an all-inf gradient backward (the loss stays finite)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("inf"))


class Injecting(pl.LightningModule):
    def __init__(self, offload: bool) -> None:
        super().__init__()
        self.layer, self.offload = torch.nn.Linear(4, 2), offload

    def training_step(self, batch, batch_idx):
        out = self.layer(batch)
        if self.global_step == INF_GRAD_STEP:
            out = InfGradient.apply(out)
        loss = out.pow(2).mean()
        return loss + float("nan") if self.global_step == NAN_LOSS_STEP else loss

    def train_dataloader(self):
        return DataLoader(torch.randn(64, 4, generator=torch.Generator().manual_seed(0)), batch_size=8)

    def configure_optimizers(self):
        if self.offload:
            from lit_speed.optim.cpu_adam import CPUAdam

            return CPUAdam(self.parameters(), lr=0.1)
        return torch.optim.AdamW(self.parameters(), lr=0.1)


class WeightsPerStep(Callback):
    """Full weights before and after every step (gathered under ZeRO-3)."""

    def __init__(self) -> None:
        self.before: dict[int, list[torch.Tensor]] = {}
        self.after: dict[int, list[torch.Tensor]] = {}

    @staticmethod
    def _weights(module):
        import deepspeed

        params = list(module.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=hasattr(params[0], "ds_id")):
            return [p.detach().clone().float() for p in params]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before[trainer.global_step] = self._weights(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after[trainer.global_step - 1] = self._weights(pl_module)


@pytest.mark.parametrize("stage, offload", [(1, False), (2, False), pytest.param(3, False, marks=pytest.mark.slow),
                                            pytest.param(2, True, marks=pytest.mark.slow)],
                         ids=["zero1", "zero2", "zero3", "zero2-offload"])
@pytest.mark.parametrize("precision", ["32-true", pytest.param("bf16-mixed", marks=pytest.mark.slow)])
def test_nan_loss_and_inf_gradient_leave_the_weights_unchanged_under_zero(tmp_path, stage, offload, precision):
    guard = GuardedPrecision(precision, on_nonfinite="skip")
    strategy = ZeroStrategy(stage=stage, offload_optimizer=offload, precision_plugin=guard)
    weights = WeightsPerStep()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=tmp_path, callbacks=[weights])
    trainer.fit(Injecting(offload))
    assert isinstance(trainer.precision_plugin, GuardedDeepSpeedPrecision)
    for step in range(STEPS):
        same = all(torch.equal(a, b) for a, b in zip(weights.before[step], weights.after[step]))
        assert same == (step in (NAN_LOSS_STEP, INF_GRAD_STEP)), f"step {step}: weights {'un' if same else ''}changed"
    assert guard.counters.skipped_steps == 2 and guard.counters.attempted_steps == STEPS
    assert trainer.precision_plugin.final_summary()["skipped_steps"] == 2
    assert all(torch.isfinite(w).all() for w in weights.after[STEPS - 1])


def test_a_nonfinite_loss_is_poisoned_so_every_gradient_is_nan():
    w = torch.ones(3, requires_grad=True)
    (w.sum() + float("nan")).backward()
    assert torch.isfinite(w.grad).all()  # why the loss needs checking too: loss + nan has finite gradients
    w.grad = None
    poison_nonfinite_loss(w.sum() + float("nan")).backward()
    assert torch.isnan(w.grad).all()
    assert torch.equal(poison_nonfinite_loss(torch.tensor(2.0)), torch.tensor(2.0))


class InjectingWithSchedule(Injecting):
    """``Injecting`` with a per-step LR schedule that records how often it stepped."""

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.scheduler, "interval": "step"}}


@pytest.mark.parametrize("stage", [1, 2])
def test_the_lr_schedule_does_not_advance_on_a_step_zero_discarded(tmp_path, stage):
    """Lightning #18828 under ZeRO: 5 steps, 2 discarded (NaN loss, inf gradient): the schedule advanced 3 times."""
    guard = GuardedPrecision("32-true", on_nonfinite="skip")
    module = InjectingWithSchedule(offload=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=stage, precision_plugin=guard),
                         max_steps=STEPS, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0,
                         default_root_dir=tmp_path)
    trainer.fit(module)
    assert guard.counters.skipped_steps == 2
    assert module.scheduler.last_epoch == STEPS - 2
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 / (STEPS - 2 + 1))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_a_nan_on_one_of_two_processes_discards_the_step_on_both(tmp_path, stage):
    """ZeRO's overflow check is all-reduced over the ranks: rank 1's NaN loss at step 2 skips the step everywhere,
    the schedule holds on both, and the ranks end with the same weights."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from tests.helpers.zero import clean_env

    script = Path(__file__).resolve().parents[1] / "helpers" / "zero_guard_2p.py"
    done = subprocess.run([sys.executable, str(script), "--out", str(tmp_path), "--stage", str(stage)],
                          capture_output=True, text=True, env=clean_env(OMP_NUM_THREADS="1"), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert rank["changed"] == [True, True, False, True, True]
        assert rank["skipped"] == 1 and rank["schedule_steps"] == 4
    assert ranks[0]["weights"] == ranks[1]["weights"]
