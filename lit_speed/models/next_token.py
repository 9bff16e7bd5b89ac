"""The training and validation steps every next-token language model here shares (bundled GPT, Hugging Face)."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lit_speed.models.configure_optimizers import configure_optimizers


class NextTokenSteps:
    """Mixin for a LightningModule whose ``forward(idx)`` returns logits and whose batches are ``(input, target)``
    token windows: float32 cross-entropy (targets ``-100`` ignored), ``train/loss`` and ``val/loss``, and the
    optimizer over ``self.model`` from ``self.optimizer_factory`` / ``self.scheduler_factory``."""

    monitor = "val/loss"
    monitor_mode = "min"

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        # the loss in float32 under autocast: log-softmax over the vocabulary is where low precision hurts
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1), ignore_index=-100)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val/loss", self._loss(batch), prog_bar=True)

    def configure_optimizers(self) -> Any:
        return configure_optimizers(self.model, self.optimizer_factory, self.scheduler_factory,
                                    self.hparams.weight_decay, self.trainer.estimated_stepping_batches,
                                    self.trainer.strategy)
