"""A callback for benchmarks: seconds since process launch at set-up, training start, the first and last batch.

``+callbacks.launch._target_=launch_clock.LaunchClock +callbacks.launch.out_path=<file>`` (with ``benchmarks/`` on
``PYTHONPATH``) adds it to ``scripts/train.py``; a plain ``Trainer`` takes it in ``callbacks=``. Writes JSON at the
end of fit.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lit_speed.reporting.fixed_validation import process_start_time


class LaunchClock(pl.Callback):
    """Records ``{event: seconds since launch}`` (setup, train_start, first_batch_start, first_batch_end, fit_end)
    and the wall seconds of each validation pass during fit (sanity checks excluded)."""

    def __init__(self, out_path: str) -> None:
        self.out_path = out_path
        self.t0 = process_start_time()
        self.events: dict[str, float] = {}
        self.batches = 0
        self.validations: list[float] = []
        self._val_start = 0.0

    def _mark(self, name: str) -> None:
        self.events.setdefault(name, round(time.time() - self.t0, 4))

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._mark("setup")

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._mark("train_start")

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        self._mark("first_batch_start")

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.batches += 1
        self._mark("first_batch_end")

    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._val_start = time.perf_counter()

    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not trainer.sanity_checking:
            self.validations.append(round(time.perf_counter() - self._val_start, 4))

    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._mark("fit_end")
        Path(self.out_path).write_text(json.dumps({"events": self.events, "batches": self.batches,
                                                   "validations_s": self.validations}))
