"""Per-step ``self.log`` of a few changing values at a fraction of the cost (shared by several callbacks)."""
from __future__ import annotations

import lightning.pytorch as pl

from lit_speed.compat.lightning import step_metrics_written_now


def log_step_metrics(trainer: "pl.Trainer", pl_module: "pl.LightningModule", values: dict[str, float],
                     last_logged: dict[str, float]) -> None:
    """``pl_module.log`` (``on_step``, rank 0) the ``values`` that changed since ``last_logged``, and all of them
    on the steps the loggers are written, so ``trainer.callback_metrics`` is always current and every logger
    row has every value, at a fraction of the cost of logging all of them on every batch."""
    due = step_metrics_written_now(trainer)
    changed = {k: v for k, v in values.items() if due or last_logged.get(k) != v}
    if changed:
        pl_module.log_dict(changed, on_step=True, on_epoch=False, rank_zero_only=True)
        last_logged.update(changed)
