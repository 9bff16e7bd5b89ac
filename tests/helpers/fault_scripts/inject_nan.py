"""A callback that poisons one training batch with NaN at a chosen step (its loss and gradients turn NaN).

Usable in-process or through Hydra (the checkout's root on PYTHONPATH):
``+callbacks.nan._target_=tests.helpers.fault_scripts.inject_nan.InjectNaN +callbacks.nan.step=5``.
"""
from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override


class InjectNaN(Callback):
    """Fill the floating-point inputs of the batches at ``step`` .. ``step + count - 1`` with NaN, in place.

    Args:
        step: First optimizer step (``trainer.global_step``) whose batch is poisoned.
        count: How many consecutive batches are poisoned.
    """

    def __init__(self, step: int, count: int = 1) -> None:
        self.step, self.count = step, count
        self.poisoned = 0

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        # a skipped step does not advance global_step, so count poisoned batches rather than steps
        if trainer.global_step >= self.step and self.poisoned < self.count:
            for tensor in batch if isinstance(batch, (list, tuple)) else [batch]:
                if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                    tensor.fill_(float("nan"))
            self.poisoned += 1
