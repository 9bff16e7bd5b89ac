"""End-of-run numbers every job reports: wall time and where it went, throughput, peak memory, best metric."""
from __future__ import annotations

import math
import statistics
import time
from typing import Any, Iterable

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lit_speed.monitoring.samplers import batch_size_and_tokens, peak_rss_bytes
from lit_speed.run_contract import PhaseTimer

#: Training batches left out of the steady-state throughput: the first ones pay for lazy set-up (allocator
#: growth, kernel selection, the optimizer's state), which a long run does not pay again.
WARMUP_BATCHES = 2


def significant(value: float | None, digits: int = 4) -> float | None:
    """``value`` rounded to ``digits`` significant digits (a rate of 0.0523/s stays 0.0523, not 0.05 or 0.0)."""
    return None if value is None else float(f"{value:.{digits}g}")


def steady_rate(amounts: list[int], seconds: list[float], warmup: int = WARMUP_BATCHES) -> float | None:
    """``sum(amount) / sum(seconds)`` over the batches after ``warmup`` (all of them when there are too few)."""
    if not amounts or not any(amounts):
        return None
    skip = warmup if len(amounts) > warmup else 0
    spent = sum(seconds[skip:])
    return sum(amounts[skip:]) / spent if spent > 0 else None


def phase_seconds_of(parts: Iterable[object]) -> dict[str, float]:
    """The seconds each :class:`~lit_speed.run_contract.PhaseTimer` among ``parts`` reports, summed by phase."""
    total: dict[str, float] = {}
    for part in parts:
        if isinstance(part, PhaseTimer):
            for phase, seconds in part.phase_seconds().items():
                total[phase] = total.get(phase, 0.0) + float(seconds)
    return total


class RunSummary(Callback):
    """Counts samples/tokens, times every phase of fit, and reports the best metric for the end-of-run summary.

    Phases inside ``fit`` (``time_split_s`` of ``summary.json``, with what the runner measures before and after):
    ``data`` (``prepare_data`` + the DataModule's ``setup``: tokenising, reading), ``fit_setup`` (model and strategy
    set-up, optimizer, restoring a checkpoint), ``sanity`` and ``validation``, ``checkpoints`` and ``export`` (as
    the components that spend them report it: :class:`~lit_speed.run_contract.PhaseTimer`), and ``training``,
    the rest: the steps, data loading between them, and the callbacks' work per batch.

    Args:
        monitor: Metric whose best value is reported (e.g. ``val/acc``).
        mode: ``"max"`` or ``"min"``.
    """

    def __init__(self, monitor: str | None = None, mode: str = "max") -> None:
        if mode not in ("max", "min"):
            raise ValueError(f"monitor_mode must be 'max' or 'min', got {mode!r}")
        self.monitor = monitor
        self.mode = mode
        self.samples = 0
        self.tokens = 0
        self.best: float | None = None
        self.best_step: int | None = None
        self.fit_called_at: float | None = None  # set by the runner just before trainer.fit
        self._setup_at: float | None = None
        self._marked_first = False  # DataReady marked this set-up round
        self._fit_start = 0.0
        self._val_start = 0.0
        self._batch_start = 0.0
        self.val_time = 0.0
        self.sanity_time = 0.0
        # (optimizer step, val metrics) of the fit's last validation: a final validation at that step would repeat it
        self.last_validation: tuple[int, dict[str, float]] | None = None
        self.wall_time = 0.0
        self.phases: dict[str, float] = {}
        self.batch_seconds: list[float] = []
        self.batch_samples: list[int] = []
        self.batch_tokens: list[int] = []

    def follow_monitor(self, monitor: str, mode: str) -> None:
        """Report the best value of ``monitor`` (chosen at the first validation), unless one was named."""
        if self.monitor is None:
            self.monitor, self.mode = monitor, mode

    def data_ready(self) -> "DataReady":
        """A callback to put first in the Trainer's list: it ends ``data`` before any other callback's ``setup`` runs
        (a regional compile, a timed choice), so their set-up counts as ``fit_setup``, not as data."""
        return DataReady(self)

    def mark_data_ready(self, stage: str, first: bool = False) -> None:
        """Lightning runs ``prepare_data`` and the DataModule's ``setup`` just before the callbacks' ``setup``: the
        first mark of a set-up round (``first``: from :class:`DataReady`) ends ``data``; this callback's own
        ``setup`` then only closes the round (alone, without a DataReady, it marks)."""
        if self._marked_first:
            self._marked_first = False
            return
        self._setup_at = time.perf_counter()
        self._marked_first = first
        if stage == "fit" and self.fit_called_at is not None:
            self.phases["data"] = self._setup_at - self.fit_called_at

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self.mark_data_ready(stage)

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._fit_start = time.perf_counter()
        if self._setup_at is not None:
            self.phases["fit_setup"] = self._fit_start - self._setup_at

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        self._batch_start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        samples, tokens = batch_size_and_tokens(batch)
        self.samples += samples
        self.tokens += tokens
        self.batch_seconds.append(time.perf_counter() - self._batch_start)
        self.batch_samples.append(samples)
        self.batch_tokens.append(tokens)

    @override
    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._val_start = time.perf_counter()

    @override
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        spent = time.perf_counter() - self._val_start
        if trainer.sanity_checking:
            self.sanity_time += spent
            return
        self.val_time += spent
        if trainer.state.fn == "fit":  # the fit's own validations, not trainer.validate()'s
            self.last_validation = (trainer.global_step, {k: float(v) for k, v in trainer.callback_metrics.items()
                                                          if k.startswith("val")})
        if self.monitor is None:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            return
        value = float(value)
        better = self.best is None or (value > self.best if self.mode == "max" else value < self.best)
        if math.isfinite(value) and better:
            self.best, self.best_step = value, trainer.global_step

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.wall_time = time.perf_counter() - self._fit_start

    def fit_phases(self, trainer: "pl.Trainer") -> dict[str, float]:
        """Seconds of each phase of fit; ``training`` is the fit wall time less every other phase inside it."""
        strategy = trainer.strategy
        reported = phase_seconds_of([*trainer.callbacks, strategy, getattr(strategy, "checkpoint_io", None)])
        phases = {**self.phases, "sanity": self.sanity_time, "validation": self.val_time,
                  "checkpoints": reported.pop("checkpoints", 0.0), "export": reported.pop("export", 0.0), **reported}
        inside = sum(v for k, v in phases.items() if k not in ("data", "fit_setup"))
        phases["training"] = max(self.wall_time - inside, 0.0)
        return phases

    def summary(self, trainer: "pl.Trainer") -> dict[str, Any]:
        phases = self.fit_phases(trainer)
        train_time = max(phases["training"], 1e-9)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if torch.is_tensor(v) and v.numel() == 1}
        steady_tokens = steady_rate(self.batch_tokens, self.batch_seconds)
        return {
            "fit_wall_time_s": round(self.wall_time, 3),
            "train_time_s": round(train_time, 3),
            "val_time_s": round(self.val_time, 3),
            "global_step": trainer.global_step,
            "samples": self.samples,
            "tokens": self.tokens,
            "samples_per_sec": significant(self.samples / train_time),
            "tokens_per_sec": significant(self.tokens / train_time) if self.tokens else None,
            # the batches after the first WARMUP_BATCHES, from batch start to batch end (loading excluded)
            "steady_samples_per_sec": significant(steady_rate(self.batch_samples, self.batch_seconds) or 0.0),
            "steady_tokens_per_sec": significant(steady_tokens) if steady_tokens else None,
            "median_batch_s": round(statistics.median(self.batch_seconds), 4) if self.batch_seconds else None,
            "time_split_s": {k: round(v, 3) for k, v in phases.items()},
            "peak_rss_bytes": peak_rss_bytes(),
            "monitor": self.monitor,
            "best_val": self.best,
            "best_step": self.best_step,
            "final_train_loss": metrics.get("train/loss"),
            "final_metrics": metrics,
        }

    @override
    def state_dict(self) -> dict[str, Any]:
        # throughput counters are per process (they pair with this process's wall time); the best metric carries over
        return {"best": self.best, "best_step": self.best_step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best = state_dict.get("best")
        self.best_step = state_dict.get("best_step")


class DataReady(Callback):
    """:meth:`RunSummary.data_ready`: marks the end of the DataModule's set-up for a :class:`RunSummary`."""

    def __init__(self, summary: RunSummary) -> None:
        self.summary = summary

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self.summary.mark_data_ready(stage, first=True)
