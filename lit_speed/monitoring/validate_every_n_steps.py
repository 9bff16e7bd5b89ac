"""Validate every N optimizer steps, whatever the gradient accumulation.

Lightning's ``val_check_interval`` counts training batches, i.e. micro-batches: under accumulation x8,
``val_check_interval=25`` validates about every 3 optimizer steps, and under a ramp (x1 -> x32) the spacing in
optimizer steps changes as the run goes (Lightning #12205, "won't fix"; #19740 proposes ``val_check_steps``).
:func:`validation_due` is the rule, :class:`ValidateEveryNSteps` hands it to Lightning's loop after every training
batch (through ``lit_speed.compat``). The decision reads only ``trainer.global_step``, so a resumed run validates at
the same steps as an uninterrupted one.
"""
from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lit_speed.compat import lightning as pl_compat
from lit_speed.monitoring.validation_budget import ValidationBudget


def validation_due(step_before: int, step_after: int, every_n_steps: int) -> bool:
    """Whether the optimizer steps made by one training batch (``step_before`` -> ``step_after``) reach a multiple
    of ``every_n_steps``; a batch that made no step (inside an accumulation window) never validates."""
    return step_after > step_before and step_after // every_n_steps > step_before // every_n_steps


class ValidateEveryNSteps(Callback):
    """Run validation after every ``every_n_steps``-th optimizer step (``trainer.global_step``), not every N
    training batches.

    It decides alone when validation runs inside an epoch: ``Trainer(val_check_interval=)`` must be left at its
    default (validation at the epoch's end is then replaced too: the run validates at steps N, 2N, ...), and
    ``check_val_every_n_epoch`` must be 1 or ``None``. Not with :class:`~lit_speed.monitoring.validation_budget.
    ValidationBudget`, which sets the interval in training batches.

    Args:
        every_n_steps: Optimizer steps between validations.

    Raises:
        ValueError: ``every_n_steps`` < 1; at setup, a ``val_check_interval`` or ``check_val_every_n_epoch`` it would
            override, or ``ValidationBudget`` in the same run.

    Example::

        trainer = Trainer(callbacks=[AccumulationScheduler(effective_batch={0: 64, 500: 512}),
                                     ValidateEveryNSteps(every_n_steps=50)])
    """

    def __init__(self, every_n_steps: int) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"ValidateEveryNSteps(every_n_steps={every_n_steps!r}): must be an int >= 1. "
                             "Fix: every_n_steps=50 (optimizer steps between validations)")
        self.every_n_steps = every_n_steps
        self._step_before = 0

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        interval = trainer.val_check_interval
        if not (isinstance(interval, float) and interval == 1.0):  # Lightning's default (null in conf/base/trainer)
            raise ValueError(f"ValidateEveryNSteps: Trainer(val_check_interval={interval!r}) would be ignored: "
                             f"every_n_steps={self.every_n_steps} decides when to validate. Fix: "
                             "trainer.val_check_interval=null")
        if trainer.check_val_every_n_epoch not in (1, None):
            raise ValueError(f"ValidateEveryNSteps: Trainer(check_val_every_n_epoch={trainer.check_val_every_n_epoch})"
                             f" would skip the steps of the other epochs (every_n_steps={self.every_n_steps}). Fix: "
                             "trainer.check_val_every_n_epoch=1")
        if any(isinstance(cb, ValidationBudget) for cb in trainer.callbacks):
            raise ValueError("ValidateEveryNSteps: ValidationBudget sets the validation cadence too (in training "
                             "batches). Fix: one of them in callbacks")

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._step_before = trainer.global_step  # a resumed run goes on from its checkpoint's step
        if 0 < trainer.max_steps < self.every_n_steps:
            rank_zero_warn(f"ValidateEveryNSteps(every_n_steps={self.every_n_steps}) > trainer.max_steps="
                           f"{trainer.max_steps}: no validation during fit. Fix: every_n_steps=<at most "
                           f"{trainer.max_steps}>")
        pl_compat.validate_after_this_batch(trainer, False)  # nothing before the first step

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        due = validation_due(self._step_before, trainer.global_step, self.every_n_steps)
        self._step_before = trainer.global_step
        pl_compat.validate_after_this_batch(trainer, due)

    def describe(self) -> dict[str, str]:
        """The start-up table's validation row."""
        return {"validation": f"every {self.every_n_steps} optimizer steps (ValidateEveryNSteps; "
                              "trainer.val_check_interval, which counts training batches, is not used)"}

    def final_summary(self) -> dict[str, Any]:
        return {"every_n_steps": self.every_n_steps}
