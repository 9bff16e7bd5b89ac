"""Refuse a run whose plan the config alone cannot show: the Trainer knows the batches per epoch at train start.

Runs before the first training batch (``on_train_start``) and at the first validation (the sanity check by
default), so a refusal costs the set-up, never a training step.
"""
from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lit_speed.run.config_error import ConfigError
from lit_speed.run.monitor import choose_monitor
from lit_speed.run_contract import AccumulationReport, MonitorFollower


def largest_accumulation_factor(callbacks: list[Any], trainer_factor: int = 1) -> int:
    """The largest micro-batches-per-step factor any accumulation callback schedules (else the Trainer's)."""
    largest = trainer_factor
    for cb in callbacks:
        factors = cb.factors if isinstance(cb, AccumulationReport) else None
        if isinstance(cb, pl.callbacks.GradientAccumulationScheduler):
            factors = cb.scheduling
        if isinstance(factors, dict):
            values = list(factors.values())
        elif isinstance(factors, (list, tuple)):
            values = [pair[1] for pair in factors if isinstance(pair, (list, tuple)) and len(pair) == 2]
        else:
            values = []
        largest = max([largest, *[v for v in values if isinstance(v, int)]])
    return largest


def planned_training_batches(max_steps: int, max_epochs: int | None, batches_per_epoch: float, factor: int) -> float:
    """Training batches a run will see: the first of ``max_steps`` x factor and ``max_epochs`` epochs to end it."""
    limits = []
    if max_steps is not None and max_steps > 0:
        limits.append(max_steps * factor)
    if max_epochs is not None and max_epochs > 0:
        limits.append(max_epochs * batches_per_epoch)
    return min(limits) if limits else math.inf


class RunPlanCheck(Callback):
    """Refuse, before training, a run that makes no full optimizer step or never validates its monitored metric.

    A run that validates only after fit (``validate=true``) is told so in one warning; with ``validate=false`` the
    metric would never be computed, and the run is refused.

    Args:
        monitor: The metric checkpoints, early stopping and the summary follow (``val/acc``, ``val/loss``); ``None``:
            chosen from the metrics the first validation logs and handed to every ``MonitorFollower``.
        final_validation: Whether the runner validates once after fit (``validate`` in ``conf/train.yaml``).

    Raises:
        ConfigError: (from the hooks) naming the setting and the fix.
    """

    def __init__(self, monitor: str | None, final_validation: bool = True) -> None:
        self.monitor = monitor
        self.final_validation = final_validation
        self._checked_metrics = False
        self._chosen: tuple[str, str] | None = None  # the monitor chosen from the logged metrics, and its mode

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.monitor is None and self._chosen is not None:  # resumed: the choice the checkpoint holds
            self._follow(trainer, *self._chosen)
        per_epoch = trainer.num_training_batches
        if per_epoch == 0:
            raise ConfigError("trainer.limit_train_batches: 0 training batches per epoch, the run would make no "
                              "optimizer step. Fix: trainer.limit_train_batches=1.0 (all batches) or >= 1")
        factor = largest_accumulation_factor(trainer.callbacks, trainer.accumulate_grad_batches)
        if per_epoch != math.inf and factor > per_epoch:
            raise ConfigError(f"accumulation factor {factor} > the {per_epoch} training batches of an epoch: every "
                              "optimizer step would be cut short at the epoch's end. "
                              f"Fix: accumulation.factors with factors <= {per_epoch} (or a larger data set)")
        if trainer.limit_val_batches == 0:
            rank_zero_warn(f"no validation batches (trainer.limit_val_batches): {self.monitor or 'no metric'} is never "
                           "computed")
            return
        total = planned_training_batches(trainer.max_steps, trainer.max_epochs, per_epoch, factor)
        every_n = trainer.check_val_every_n_epoch
        if every_n is None and isinstance(trainer.val_check_interval, int) and trainer.val_check_interval > total:
            self._never_validated(f"trainer.val_check_interval={trainer.val_check_interval} > the {int(total)} "
                                  "training batches of this run", f"trainer.val_check_interval=<at most {int(total)}>")
        if every_n is not None and trainer.max_epochs is not None and 0 < trainer.max_epochs < every_n \
                and trainer.max_steps in (-1, None):
            self._never_validated(f"trainer.check_val_every_n_epoch={every_n} > trainer.max_epochs="
                                  f"{trainer.max_epochs}", f"trainer.check_val_every_n_epoch=<at most "
                                  f"{trainer.max_epochs}>")

    def _never_validated(self, why: str, fix: str) -> None:
        metric = self.monitor or "the monitored metric"
        if not self.final_validation:
            raise ConfigError(f"{why}: {metric} would never be validated (validate=false). Fix: {fix}, "
                              "or validate=true")
        rank_zero_warn(f"{why}: {metric} is validated only once, after fit (no validation, no best "
                       f"checkpoint during fit). Fix: {fix}")

    @override
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # runs before ModelCheckpoint's and EarlyStopping's hooks (Lightning moves those last), and before RunSummary
        if self._checked_metrics:
            return
        self._checked_metrics = True
        logged = sorted(k for k in trainer.callback_metrics if not k.endswith(("_step", "_epoch")))
        if self.monitor is None:
            self._choose_monitor(trainer, logged)
            return
        if self.monitor not in trainer.callback_metrics:
            raise ConfigError(f"monitor={self.monitor}: the model does not log it (it logs {', '.join(logged)}). "
                              f"Fix: monitor=<one of those>, or monitor=null for the model's own")

    def _choose_monitor(self, trainer: "pl.Trainer", logged: list[str]) -> None:
        """No metric named (config, model, callback config): follow the validation metric the model logs."""
        chosen = choose_monitor(logged)
        if chosen is None:
            rank_zero_warn(f"monitor=null and the model names no metric, and validation logged none of "
                           f"{', '.join(logged) or 'its metrics'} under a val name: no best checkpoint or best value "
                           "is kept. Fix: monitor=<metric> monitor_mode=<min|max>")
            return
        self._follow(trainer, *chosen)
        rank_zero_info(f"monitor: {self.monitor} ({chosen[1]}), chosen from the metrics the first validation logged "
                       f"({', '.join(logged)}); monitor=<metric> monitor_mode=<min|max> chooses another")

    def _follow(self, trainer: "pl.Trainer", monitor: str, mode: str) -> None:
        self.monitor, self._chosen = monitor, (monitor, mode)
        for callback in trainer.callbacks:
            if isinstance(callback, MonitorFollower):
                callback.follow_monitor(monitor, mode)

    @override
    def state_dict(self) -> dict[str, Any]:
        # a resumed run follows the metric the first run chose, even if it validates only after fit
        return {"chosen": list(self._chosen)} if self._chosen is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        chosen = state_dict.get("chosen")
        self._chosen = (str(chosen[0]), str(chosen[1])) if chosen else None
