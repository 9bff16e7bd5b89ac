"""The non-finite guard under ZeRO: a step with an inf/NaN loss or gradient is discarded by DeepSpeed itself.

DeepSpeed's ZeRO optimizers already know how to discard a step: on an fp16 overflow they zero the gradient
partitions, skip the update and count ``engine.skipped_steps``. Outside fp16 that check is off (stages 1/2
with fp32) or only sees the gradients (a NaN *loss* whose gradients are finite is stepped on).
:class:`GuardedDeepSpeedPrecision` turns the check on for every dtype and makes a non-finite loss give NaN
gradients (``loss * nan`` instead of ``loss``), so every bad step takes DeepSpeed's own discard path in every
stage, with or without offload. The source ``GuardedPrecision`` counts the skipped steps.
"""
from __future__ import annotations

from typing import Any, Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import DeepSpeedPrecision
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lit_speed.precision.nonfinite import Action, GuardCounters, decide
from lit_speed.precision.skip_aware_scheduler import SkipAwareScheduler


def poison_nonfinite_loss(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` unchanged when finite; otherwise ``loss * nan``, whose gradient is NaN for every parameter.

    ``loss + nan`` back-propagates a gradient of 1 and leaves the parameters' gradients finite, so a gradient
    check alone would let such a step through. No host synchronisation.
    """
    scale = torch.where(torch.isfinite(loss.detach()), torch.ones_like(loss), torch.full_like(loss, float("nan")))
    return loss * scale


class GuardedDeepSpeedPrecision(DeepSpeedPrecision):
    """DeepSpeed's precision plugin with ``GuardedPrecision(on_nonfinite="skip")``'s guarantee.

    Args:
        precision: A Lightning precision literal DeepSpeed accepts.
        source: The ``GuardedPrecision`` it replaces; its ``counters`` (when it has them) record attempted and
            skipped steps.
    """

    def __init__(self, precision: Any, source: Any) -> None:
        super().__init__(precision)
        self.source = source
        counters = getattr(source, "counters", None)
        self.counters: GuardCounters = counters if isinstance(counters, GuardCounters) else GuardCounters()
        self.last_step_skipped = False  # read by the LR-scheduler wrapper: no schedule step for a discarded step

    @override
    def backward(self, tensor: torch.Tensor, model: "pl.LightningModule", optimizer: Any, *args: Any,
                 **kwargs: Any) -> None:
        super().backward(poison_nonfinite_loss(tensor), model, optimizer, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, model: "pl.LightningModule", closure: Callable[[], Any],
                       **kwargs: Any) -> Any:
        trainer = model.trainer
        for config in trainer.lr_scheduler_configs:  # Lightning steps the schedule after a discarded step too (#18828)
            if not isinstance(config.scheduler, SkipAwareScheduler):
                config.scheduler = SkipAwareScheduler(config.scheduler, lambda: self.last_step_skipped)
        engine = trainer.model
        zero_optimizer = getattr(engine, "optimizer", None)
        if hasattr(zero_optimizer, "check_grad_overflow"):  # stages 1/2 leave it off for fp32
            zero_optimizer.check_grad_overflow = True
        boundary = engine.is_gradient_accumulation_boundary()
        skipped_before = engine.skipped_steps
        result = super().optimizer_step(optimizer, model, closure, **kwargs)
        if boundary:
            bad = engine.skipped_steps > skipped_before
            self.last_step_skipped = bad
            action = decide(self.counters, bad, True, "skip", 1, False)
            if action is Action.SKIP and self.counters.skipped_steps == 1:
                rank_zero_warn(f"GuardedPrecision under ZeRO: a non-finite loss or gradient at step "
                               f"{model.trainer.global_step}; DeepSpeed discarded the step (counted in "
                               "precision/skipped_steps). Later ones are counted without a warning.")
        return result

    def final_summary(self) -> dict[str, Any]:
        """The source plugin's end-of-run numbers (attempted and skipped steps) for ``summary.json``."""
        return {"attempted_steps": self.counters.attempted_steps,
                "skipped_steps": self.counters.skipped_steps,
                "nonfinite_rate": self.counters.nonfinite_rate, "guard": "DeepSpeed discards non-finite steps"}

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"counters": self.counters.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.counters.load_state_dict(state_dict.get("counters", {}))
