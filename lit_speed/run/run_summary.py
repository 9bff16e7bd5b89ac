"""End-of-run numbers every job reports: wall time, throughput, peak memory, best metric."""
from __future__ import annotations

import math
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lit_speed.monitoring.samplers import batch_size_and_tokens, peak_rss_bytes


class RunSummary(Callback):
    """Counts samples/tokens and times training (validation excluded) for the end-of-run summary.

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
        self._fit_start = 0.0
        self._val_start = 0.0
        self.val_time = 0.0
        self.wall_time = 0.0

    def follow_monitor(self, monitor: str, mode: str) -> None:
        """Report the best value of ``monitor`` (chosen at the first validation), unless one was named."""
        if self.monitor is None:
            self.monitor, self.mode = monitor, mode

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._fit_start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        samples, tokens = batch_size_and_tokens(batch)
        self.samples += samples
        self.tokens += tokens

    @override
    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._val_start = time.perf_counter()

    @override
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.val_time += time.perf_counter() - self._val_start
        if trainer.sanity_checking or self.monitor is None:
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

    def summary(self, trainer: "pl.Trainer") -> dict[str, Any]:
        train_time = max(self.wall_time - self.val_time, 1e-9)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if torch.is_tensor(v) and v.numel() == 1}
        return {
            "fit_wall_time_s": round(self.wall_time, 3),
            "train_time_s": round(train_time, 3),
            "val_time_s": round(self.val_time, 3),
            "global_step": trainer.global_step,
            "samples": self.samples,
            "tokens": self.tokens,
            "samples_per_sec": round(self.samples / train_time, 2),
            "tokens_per_sec": round(self.tokens / train_time, 2) if self.tokens else None,
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
