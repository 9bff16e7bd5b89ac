"""Measure the wall time a run takes to first reach a target validation metric."""
from __future__ import annotations

import math
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override


def target_met(value: float, target: float, mode: str) -> bool:
    """``value <= target`` for ``mode="min"`` (losses), ``value >= target`` for ``"max"``; NaN never meets it."""
    if not math.isfinite(value):
        return False
    return value <= target if mode == "min" else value >= target


class TimeToTarget(Callback):
    """Records the seconds since ``fit`` started and the optimizer step of the first validation that meets a target.

    A measuring instrument, not a speed feature: put the same one in every run you compare. The clock
    starts at ``on_fit_start`` (so it includes the sanity check, compilation, data start-up and every
    validation pass: the time a user waits). The result appears in ``summary.json`` under
    ``components.TimeToTarget`` and in the sweep report's "time to target" column.

    Args:
        target: The metric value to reach (e.g. ``2.2`` for ``val/loss``).
        monitor: The validation metric to watch.
        mode: ``"min"`` (reached when ``value <= target``) or ``"max"`` (``value >= target``).
        stop: Stop training at the first validation that meets the target (saves time in benchmarks).

    Raises:
        ValueError: ``target`` is not a finite number or ``mode`` is not ``"min"``/``"max"``.

    Example::

        trainer = Trainer(callbacks=[TimeToTarget(target=2.2, monitor="val/loss", mode="min", stop=True)])
        # Hydra: +callbacks.time_to_target._target_=lit_speed.reporting.TimeToTarget
        #        +callbacks.time_to_target.target=2.2 +callbacks.time_to_target.stop=true
    """

    def __init__(self, target: float, monitor: str = "val/loss", mode: str = "min", stop: bool = False) -> None:
        if isinstance(target, bool) or not isinstance(target, (int, float)) or not math.isfinite(target):
            raise ValueError(f"time_to_target.target must be a finite number (e.g. 2.2 for val/loss), got {target!r}")
        if mode not in ("min", "max"):
            raise ValueError(f"time_to_target.mode must be 'min' (losses) or 'max' (accuracies), got {mode!r}")
        self.target = float(target)
        self.monitor = monitor
        self.mode = mode
        self.stop = stop
        self.time_to_target_s: float | None = None
        self.target_step: int | None = None
        self.cpu_time_to_target_s: float | None = None
        self._elapsed_before = 0.0  # seconds spent in earlier processes of a resumed run
        self._cpu_before = 0.0
        self._start = 0.0
        self._cpu_start = 0.0

    def elapsed(self) -> float:
        """Wall seconds since fit start (plus those of earlier processes of a resumed run)."""
        return self._elapsed_before + (time.perf_counter() - self._start)

    def cpu_elapsed(self) -> float:
        """This process's CPU seconds since fit start: on a shared machine, far steadier than wall time."""
        return self._cpu_before + (time.process_time() - self._cpu_start)

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._start = time.perf_counter()
        self._cpu_start = time.process_time()

    @override
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if trainer.sanity_checking or self.time_to_target_s is not None:
            return
        value = trainer.callback_metrics.get(self.monitor)
        met = value is not None and target_met(float(value), self.target, self.mode)
        if self.stop:
            # every rank takes part in the reduction, so a rank whose metric differs cannot hang the others
            met = trainer.strategy.reduce_boolean_decision(met, all=False)
            trainer.should_stop = trainer.should_stop or met
        if not met:
            return
        self.time_to_target_s = round(self.elapsed(), 3)
        self.cpu_time_to_target_s = round(self.cpu_elapsed(), 3)
        self.target_step = trainer.global_step
        shown = "?" if value is None else f"{float(value):.4f}"
        rank_zero_info(f"TimeToTarget: {self.monitor}={shown} met target {self.target} at step "
                       f"{self.target_step}, {self.time_to_target_s:.1f} s after fit start")

    def final_summary(self) -> dict[str, Any]:
        return {"target": self.target, "monitor": self.monitor, "mode": self.mode,
                "reached": self.time_to_target_s is not None, "time_to_target_s": self.time_to_target_s,
                "cpu_time_to_target_s": self.cpu_time_to_target_s, "target_step": self.target_step}

    def describe(self) -> dict[str, str]:
        op = "<=" if self.mode == "min" else ">="
        return {"time to target": f"{self.monitor} {op} {self.target}" + (" (stops there)" if self.stop else "")}

    @override
    def state_dict(self) -> dict[str, Any]:
        started = bool(self._start)
        return {"time_to_target_s": self.time_to_target_s, "cpu_time_to_target_s": self.cpu_time_to_target_s,
                "target_step": self.target_step, "elapsed_s": self.elapsed() if started else self._elapsed_before,
                "cpu_elapsed_s": self.cpu_elapsed() if started else self._cpu_before}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.time_to_target_s = state_dict.get("time_to_target_s")
        self.target_step = state_dict.get("target_step")
        self.cpu_time_to_target_s = state_dict.get("cpu_time_to_target_s")
        self._elapsed_before = float(state_dict.get("elapsed_s", 0.0))
        self._cpu_before = float(state_dict.get("cpu_elapsed_s", 0.0))
