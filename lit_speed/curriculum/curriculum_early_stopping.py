"""Early stopping that counts patience in steps, validation checks or seconds and waits for the curriculum."""
from __future__ import annotations

import math
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lit_speed.step_logging import log_step_metrics

PATIENCE_UNITS = ("checks", "steps", "seconds")
MODES = ("min", "max")


def improved(current: float, best: float, mode: str, min_delta: float) -> bool:
    """True if ``current`` beats ``best`` by more than ``min_delta`` in the direction of ``mode``."""
    return current < best - min_delta if mode == "min" else current > best + min_delta


def reached(current: float, target: float, mode: str) -> bool:
    """True if ``current`` meets the target (``<=`` for ``min``, ``>=`` for ``max``)."""
    return current <= target if mode == "min" else current >= target


class CurriculumEarlyStopping(Callback):
    """Stop on a target, on divergence, on a non-finite metric, on exhausted patience or on a time budget.

    Unlike Lightning's ``EarlyStopping``, patience may be counted in optimizer steps or in seconds of
    training as well as in validation checks, and it is not counted while the DataModule reports
    ``is_widening`` (a :class:`~lit_speed.CurriculumDataModule` still growing its allowed set or sequence
    length): the patience clock starts when the full data is in use. ``stop_at``, divergence and non-finite
    metrics stop at any time. Every stop decision is reduced across ranks (any rank stopping stops all).

    Args:
        monitor: Validation metric to watch, e.g. ``val/loss``.
        mode: ``min`` or ``max``.
        patience: Checks, steps or seconds without improvement before stopping; ``None`` = no patience rule.
        patience_unit: ``checks``, ``steps`` or ``seconds``.
        min_delta: An improvement must beat the best value by more than this.
        stop_at: Stop on the first check whose metric meets this target; its step and time are recorded.
        divergence_threshold: Stop once the metric is worse than this.
        check_finite: Stop when the metric is NaN or infinite.
        time_budget_s: Stop after this many seconds of training (checked after every batch; resumes keep the clock).
        wait_for_curriculum: Do not count patience while the DataModule is widening.
        strict: Raise if ``monitor`` is missing from the validation metrics.

    Raises:
        ValueError: On an unknown ``mode`` or ``patience_unit``, or a negative patience, delta or budget.

    Example::

        stopper = CurriculumEarlyStopping("val/acc", mode="max", stop_at=0.95, patience=200, patience_unit="steps")
        trainer = pl.Trainer(callbacks=[stopper]); trainer.fit(model, datamodule=dm)
        stopper.final_summary()  # {"reason": "target", "target_step": ..., "target_time_s": ...}
    """

    def __init__(self, monitor: str, mode: str = "min", patience: float | None = 3, patience_unit: str = "checks",
                 min_delta: float = 0.0, stop_at: float | None = None, divergence_threshold: float | None = None,
                 check_finite: bool = True, time_budget_s: float | None = None, wait_for_curriculum: bool = True,
                 strict: bool = True) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"CurriculumEarlyStopping(mode={mode!r}): mode must be one of {MODES}, got {mode!r}")
        if patience_unit not in PATIENCE_UNITS:
            raise ValueError(f"CurriculumEarlyStopping(patience_unit={patience_unit!r}): patience_unit must be one of "
                             f"{PATIENCE_UNITS}, got {patience_unit!r}")
        for name, value in (("patience", patience), ("min_delta", min_delta), ("time_budget_s", time_budget_s)):
            if value is not None and value < 0:
                raise ValueError(f"CurriculumEarlyStopping({name}={value!r}): {name} must be >= 0 (or None to disable), "
                                 f"got {value}")
        self.monitor, self.mode, self.patience, self.patience_unit = monitor, mode, patience, patience_unit
        self.min_delta, self.stop_at, self.divergence_threshold = min_delta, stop_at, divergence_threshold
        self.check_finite, self.time_budget_s = check_finite, time_budget_s
        self.wait_for_curriculum, self.strict = wait_for_curriculum, strict
        self.best = math.inf if mode == "min" else -math.inf
        self.best_step: int | None = None
        self.anchor = {"checks": 0, "steps": 0, "seconds": 0.0}  # where the patience clock last restarted
        self.checks = 0
        self.reason: str | None = None
        self.message: str | None = None
        self.stopped_step: int | None = None
        self.target_step: int | None = None
        self.target_time_s: float | None = None
        self._elapsed_before = 0.0  # training seconds of earlier (resumed) runs
        self._start: float | None = None
        self._last_logged: dict[str, float] = {}

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(monitor=self.monitor, mode=self.mode)

    def elapsed(self) -> float:
        """Seconds of training so far, including earlier runs this one resumed from."""
        return self._elapsed_before + (time.perf_counter() - self._start if self._start is not None else 0.0)

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._start = time.perf_counter()
        self._last_logged: dict[str, float] = {}  # a new fit starts with empty callback_metrics

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        dm = trainer.datamodule
        if hasattr(dm, "fraction_at"):  # a CurriculumDataModule: log where the curriculum stands
            g = max(dm.batches_seen - 1, 0)
            values = {"curriculum/allowed_fraction": float(dm.fraction_at(g))}
            if dm.seq_len_at(g) is not None:
                values["curriculum/seq_len_tokens"] = float(dm.seq_len_at(g))
            log_step_metrics(trainer, pl_module, values, self._last_logged)
        if self.time_budget_s is None or self.reason is not None:
            return
        over = trainer.strategy.broadcast(self.elapsed() >= self.time_budget_s)  # rank 0's clock decides
        if over:
            self._stop(trainer, "time_budget", f"wall-clock budget of {self.time_budget_s:g} s used up "
                                               f"({self.elapsed():.1f} s of training)")

    @override
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if trainer.sanity_checking or trainer.fast_dev_run or trainer.state.fn != "fit" or self.reason is not None:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            if self.strict:
                raise RuntimeError(f"early stopping monitors {self.monitor!r}, which was not logged; available: "
                                   f"{sorted(trainer.callback_metrics)}; set CurriculumEarlyStopping(monitor=...)")
            return
        widening = self.wait_for_curriculum and bool(getattr(trainer.datamodule, "is_widening", False))
        reason, message = self.check(float(value), trainer.global_step, self.elapsed(), widening)
        stop = trainer.strategy.reduce_boolean_decision(reason is not None, all=False)
        if stop:
            self._stop(trainer, reason or "other_rank", message or "another rank decided to stop")

    def check(self, current: float, step: int, seconds: float, widening: bool) -> tuple[str | None, str | None]:
        """Update the counters with one validation value; return ``(reason, message)`` or ``(None, None)``."""
        self.checks += 1
        now = {"checks": self.checks, "steps": step, "seconds": seconds}
        if self.check_finite and not math.isfinite(current):
            return "non_finite", f"{self.monitor} = {current} is not finite (best {self.best:.4f} at step {self.best_step})"
        if self.stop_at is not None and reached(current, self.stop_at, self.mode):
            if improved(current, self.best, self.mode, 0.0):  # the check that met the target is the best so far
                self.best, self.best_step = current, step
            self.target_step, self.target_time_s = step, round(seconds, 3)
            return "target", f"{self.monitor} = {current:.4f} reached stop_at={self.stop_at} at step {step} ({seconds:.1f} s)"
        if self.divergence_threshold is not None and not reached(current, self.divergence_threshold, self.mode):
            return "divergence", f"{self.monitor} = {current:.4f} is worse than divergence_threshold={self.divergence_threshold}"
        if improved(current, self.best, self.mode, self.min_delta) or widening:
            if improved(current, self.best, self.mode, self.min_delta):
                self.best, self.best_step = current, step
            self.anchor = dict(now)  # the patience clock (re)starts at an improvement and while widening
            return None, None
        waited = now[self.patience_unit] - self.anchor[self.patience_unit]
        if self.patience is not None and waited >= self.patience:
            return "patience", (f"{self.monitor} did not improve by more than {self.min_delta} for {waited:g} "
                                f"{self.patience_unit} (best {self.best:.4f} at step {self.best_step})")
        return None, None

    def _stop(self, trainer: "pl.Trainer", reason: str, message: str) -> None:
        trainer.should_stop = True
        self.reason, self.message, self.stopped_step = reason, message, trainer.global_step
        rank_zero_info(f"CurriculumEarlyStopping: stopping ({reason}): {message}")
        metrics = {"early_stopping/stopped_step": float(trainer.global_step), "early_stopping/train_time_s": self.elapsed()}
        if self.target_time_s is not None:
            metrics["early_stopping/target_time_s"] = self.target_time_s
        for logger in trainer.loggers:  # the reason text is in final_summary(); loggers get the numbers
            logger.log_metrics(metrics, step=trainer.global_step)

    def final_summary(self) -> dict[str, Any]:
        """The stop reason and, if ``stop_at`` was met, the step and training seconds it took."""
        return {"reason": self.reason or "not_stopped", "message": self.message, "stopped_step": self.stopped_step,
                "best": None if math.isinf(self.best) else self.best, "best_step": self.best_step,
                "target": self.stop_at, "target_step": self.target_step, "target_time_s": self.target_time_s}

    def describe(self) -> dict[str, str]:
        parts = [f"{self.monitor} ({self.mode})"]
        if self.patience is not None:
            parts.append(f"patience {self.patience:g} {self.patience_unit}")
        if self.stop_at is not None:
            parts.append(f"stop_at {self.stop_at}")
        if self.time_budget_s is not None:
            parts.append(f"budget {self.time_budget_s:g} s")
        return {"early stopping": ", ".join(parts) + (", waits for curriculum" if self.wait_for_curriculum else "")}

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "anchor": dict(self.anchor), "checks": self.checks,
                "reason": self.reason, "message": self.message, "stopped_step": self.stopped_step,
                "target_step": self.target_step, "target_time_s": self.target_time_s, "elapsed_s": self.elapsed()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best = state_dict.get("best", self.best)
        self.best_step = state_dict.get("best_step")
        self.anchor = dict(state_dict.get("anchor", self.anchor))
        self.checks = state_dict.get("checks", 0)
        self.reason, self.message = state_dict.get("reason"), state_dict.get("message")
        self.stopped_step = state_dict.get("stopped_step")
        self.target_step, self.target_time_s = state_dict.get("target_step"), state_dict.get("target_time_s")
        self._elapsed_before = float(state_dict.get("elapsed_s", 0.0))
