"""Non-finite injection: a NaN batch at a chosen step, under every precision mode and guard policy.

The policy is GuardedPrecision's (issue 3): ``skip`` and ``fallback`` keep the NaN out of the weights,
``raise`` stops the run with its message. Without a guard (Lightning's plain precision) the NaN reaches the
weights, and FaultTolerance makes sure the run does not end silently.
"""
from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lit_speed.checkpointing import FaultTolerance  # noqa: E402
from lit_speed.checkpointing.fault_tolerance import nonfinite_parameters  # noqa: E402
from lit_speed.data.digits import DigitsDataModule  # noqa: E402
from lit_speed.models.mlp import MLPClassifier  # noqa: E402
from lit_speed.precision.guarded_precision import GuardedPrecision  # noqa: E402
from tests.helpers.fault_scripts.inject_nan import InjectNaN

NAN_STEP = 2
STEPS = 5
# the default tier covers fp32 and bf16 autocast; the other two modes run in the slow tier
MODES = ["32-true", "bf16-mixed", pytest.param("16-mixed", marks=pytest.mark.slow),
         pytest.param("bf16-true", marks=pytest.mark.slow)]


def _fit(precision_plugin=None, precision: str | None = None, fault_tolerance: FaultTolerance | None = None,
         nan_batches: int = 1) -> tuple[pl.Trainer, pl.LightningModule, FaultTolerance]:
    pl.seed_everything(0)
    model = MLPClassifier(hidden=16, depth=1, dropout=0.0, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    ft = fault_tolerance or FaultTolerance()
    trainer = pl.Trainer(accelerator="cpu", max_steps=STEPS, limit_val_batches=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         plugins=[precision_plugin] if precision_plugin else None,
                         precision=precision if precision_plugin is None else None,
                         callbacks=[InjectNaN(NAN_STEP, count=nan_batches), ft])
    trainer.fit(model, datamodule=DigitsDataModule(batch_size=32))
    return trainer, model, ft


@pytest.mark.parametrize("mode", MODES)
def test_skip_keeps_the_nan_out_of_the_weights(mode):
    plugin = GuardedPrecision(mode, on_nonfinite="skip")
    trainer, model, ft = _fit(plugin)
    assert nonfinite_parameters(model) == []
    assert plugin.counters.skipped_steps == 1
    summary = ft.final_summary()
    assert summary["weights_finite"] is True
    assert summary["nonfinite_losses"] == 1 and summary["first_nonfinite_loss_step"] == NAN_STEP


@pytest.mark.parametrize("mode", MODES)
def test_raise_stops_at_the_poisoned_step_with_the_plugins_message(mode):
    with pytest.raises(FloatingPointError, match=rf"non-finite values at step {NAN_STEP} under {mode}.*Try "):
        _fit(GuardedPrecision(mode, on_nonfinite="raise"))


@pytest.mark.parametrize("mode", ["bf16-mixed", pytest.param("16-mixed", marks=pytest.mark.slow)])
def test_fallback_moves_down_the_chain_and_keeps_the_weights_finite(mode):
    plugin = GuardedPrecision(mode, on_nonfinite="fallback", fallback_after=1)
    with pytest.warns(UserWarning, match=rf"non-finite steps under {mode}.*continuing in"):
        _, model, ft = _fit(plugin)
    assert plugin.mode != mode and plugin.counters.fallbacks[0]["from"] == mode
    assert nonfinite_parameters(model) == [] and ft.final_summary()["weights_finite"] is True


def test_fallback_at_the_end_of_the_chain_raises():
    # 32-true has nothing to fall back to: a genuine NaN is not a precision problem
    with pytest.raises(FloatingPointError, match="not a precision problem"):
        _fit(GuardedPrecision("32-true", on_nonfinite="fallback", fallback_after=1))


def test_without_a_guard_the_nan_reaches_the_weights_and_the_run_says_so():
    with pytest.warns(UserWarning, match=r"Training ended with non-finite weights in \d+ parameter\(s\).*"
                                         rf"first non-finite loss was at step {NAN_STEP}.*Fix: "):
        _, model, ft = _fit(precision="32-true")
    assert nonfinite_parameters(model)  # Lightning's own precision let it through
    summary = ft.final_summary()
    assert summary["weights_finite"] is False and summary["nonfinite_weights"] == nonfinite_parameters(model)


def test_without_a_guard_on_nonfinite_weights_raise_fails_the_run():
    with pytest.raises(RuntimeError, match="Training ended with non-finite weights"):
        _fit(precision="32-true", fault_tolerance=FaultTolerance(on_nonfinite_weights="raise"))
