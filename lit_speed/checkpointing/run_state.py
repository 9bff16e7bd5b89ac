"""What a checkpoint must hold besides weights and optimizer for a resumed run to read like the uninterrupted one.

Lightning checkpoints neither the random-number generators (:mod:`lit_speed.checkpointing.resume`), nor what a
``torchmetrics`` metric accumulated so far in the epoch (its states are registered ``persistent=False``), nor the
log row it writes right after the hook that saved the checkpoint. Without them a run resumed mid-epoch logs that
epoch's ``train/acc`` over the resumed batches only (each process's share, under DDP), and a run resumed from a
checkpoint written at a batch's or an epoch's end never writes that batch's or epoch's row to ``metrics.csv``.
The functions here read and put back those pieces; :class:`~lit_speed.checkpointing.FaultTolerance` stores them.
"""
from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from lit_speed.checkpointing.resume import rng_state
from lit_speed.compat.lightning_loops import in_epoch_end_hooks, log_row_written_after_this_hook
from lit_speed.compat.torchmetrics import set_metric_state


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def metric_states(module: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Every ``torchmetrics`` metric inside ``module`` that has been updated: ``{name: {"state", "update_count"}}``,
    copies (the metrics go on accumulating into their own tensors)."""
    from torchmetrics import Metric

    return {name: {"state": {k: _copy(v) for k, v in m.metric_state.items()}, "update_count": m.update_count}
            for name, m in module.named_modules() if isinstance(m, Metric) and m.update_count > 0}


def load_metric_states(module: torch.nn.Module, states: dict[str, dict[str, Any]]) -> list[str]:
    """Put back what :func:`metric_states` read (metrics not in ``states`` are left alone); returns their names."""
    from torchmetrics import Metric

    restored = []
    for name, m in module.named_modules():
        saved = states.get(name)
        if isinstance(m, Metric) and saved is not None:
            set_metric_state(m, saved["state"], saved["update_count"])
            restored.append(name)
    return restored


def rank_part(module: torch.nn.Module | None) -> dict[str, Any]:
    """This process's share of the run state that only it holds: its RNG states and its metric states."""
    return {"rng": rng_state(), "metrics": metric_states(module) if module is not None else {}}


def pending_log_row(trainer: "pl.Trainer") -> dict[str, Any] | None:
    """The log row Lightning writes right after the hook now running (``None`` if it writes none there), as
    ``{"metrics": {name: float}, "epoch": e, "step": s}``: a checkpoint written now does not contain it yet."""
    row = log_row_written_after_this_hook(trainer)
    if row is None or not row[0]:
        return None
    metrics, epoch, step = row
    return {"metrics": {k: float(v) for k, v in metrics.items()}, "epoch": int(epoch), "step": int(step)}


def write_log_row(row: dict[str, Any], loggers: list[Any]) -> None:
    """Write ``row`` (from :func:`pending_log_row`) to ``loggers``, those that restored their rows from the
    checkpoint: the interrupted run wrote it after the checkpoint, so the restored file lacks it."""
    for logger in loggers:
        logger.log_metrics({**row["metrics"], "epoch": row["epoch"]}, step=row["step"])
        logger.save()


def at_epoch_end(trainer: "pl.Trainer") -> bool:
    """Whether the fit loop is between an epoch's last batch and its end (``on_train_epoch_end``)."""
    return in_epoch_end_hooks(trainer)
