"""A small MLP classifier (the default ``model=mlp`` for ``data=digits``)."""
from __future__ import annotations

from typing import Any, Callable

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from lit_speed.models.configure_optimizers import configure_optimizers


class MLPClassifier(pl.LightningModule):
    """``in_features -> hidden x depth -> num_classes`` with GELU and dropout; logs loss and accuracy.

    Args:
        in_features: Input features (64 for 8x8 digits).
        num_classes: Output classes.
        hidden: Width of each hidden layer.
        depth: Number of hidden layers.
        dropout: Dropout after each hidden layer.
        optimizer: Factory ``params -> Optimizer`` (a Hydra ``_partial_``).
        scheduler: Optional factory ``(optimizer, total_steps) -> LRScheduler``, stepped every optimizer step.
        weight_decay: Weight decay applied to weight matrices only.
    """

    monitor = "val/acc"  # default metric for checkpointing, early stopping and sweeps
    monitor_mode = "max"
    accepted_batch_kinds = ("features->class",)  # lit_speed.run_contract.BatchConsumer

    def __init__(self, in_features: int = 64, num_classes: int = 10, hidden: int = 256, depth: int = 2,
                 dropout: float = 0.1, optimizer: Callable[..., torch.optim.Optimizer] | None = None,
                 scheduler: Callable[..., Any] | None = None, weight_decay: float = 0.0) -> None:
        super().__init__()
        if depth < 1 or hidden < 1:
            bad = "depth" if depth < 1 else "hidden"
            raise ValueError(f"MLPClassifier({bad}={depth if bad == 'depth' else hidden}): depth and hidden must be "
                             f">= 1, got depth={depth}, hidden={hidden}")
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.GELU(), nn.Dropout(dropout)]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.train_acc = MulticlassAccuracy(num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.float(), y)
        self.train_acc(logits.detach(), y)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val/loss", F.cross_entropy(logits.float(), y), prog_bar=True)
        self.val_acc(logits, y)
        self.log("val/acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self) -> Any:
        return configure_optimizers(self, self.optimizer_factory, self.scheduler_factory,
                                    self.hparams.weight_decay, self.trainer.estimated_stepping_batches)
