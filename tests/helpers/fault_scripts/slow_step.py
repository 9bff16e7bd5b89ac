"""A callback that makes training steps slow on purpose: a step longer than a signal deadline, on a tiny model.

``+callbacks.slow._target_=tests.helpers.fault_scripts.slow_step.SlowStep +callbacks.slow.seconds=60
+callbacks.slow.from_step=12`` sleeps 60 s inside every training batch from optimizer step 12 on (after the batch
is fetched and before its forward, so the step is in flight), in every process. Sleeping releases the GIL, as a
long matmul does; the math of the step is unchanged. ``+callbacks.slow.where=validation`` makes each validation
batch slow instead (a validation longer than the deadline, after the step's update).
"""
from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override


class SlowStep(Callback):
    """Sleep ``seconds`` in each training (or validation) batch once ``trainer.global_step >= from_step``."""

    def __init__(self, seconds: float = 60.0, from_step: int = 0, where: str = "train") -> None:
        if where not in ("train", "validation"):
            raise ValueError(f"where must be 'train' or 'validation', got {where!r}")
        self.seconds, self.from_step, self.where = seconds, from_step, where

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        if self.where == "train" and trainer.global_step >= self.from_step:
            print(f"[rank {trainer.global_rank}] slow step {trainer.global_step + 1} begins", flush=True)
            time.sleep(self.seconds)

    @override
    def on_validation_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.where == "validation" and not trainer.sanity_checking and trainer.global_step >= self.from_step:
            print(f"[rank {trainer.global_rank}] slow validation after step {trainer.global_step} begins", flush=True)
            time.sleep(self.seconds)
