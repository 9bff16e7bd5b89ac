"""The training and validation steps every next-token language model here shares (bundled GPT, Hugging Face)."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import lit_speed  # the public names: chunked_lm_loss (lit_speed.memory)
from lit_speed.models.configure_optimizers import configure_optimizers


class NextTokenSteps:
    """Mixin for a LightningModule whose ``forward(idx)`` returns logits and whose batches are ``(input, target)``
    token windows: float32 cross-entropy (targets ``-100`` ignored), ``train/loss`` and ``val/loss``, and the
    optimizer over ``self.model`` from ``self.optimizer_factory`` / ``self.scheduler_factory``.

    With :meth:`use_chunked_loss` (``lit_speed.interfaces.ChunkedLossModel``) the loss runs the LM head and the
    cross-entropy in chunks of tokens (``lit_speed.chunked_lm_loss``) on what ``head_inputs(idx)`` returns: the final
    hidden states, the head's weight and bias, and the logit transform."""

    monitor = "val/loss"
    monitor_mode = "min"
    loss_chunk_bytes: int | None = None

    def use_chunked_loss(self, chunk_bytes: int | None) -> None:
        """Compute the loss in chunks of at most ``chunk_bytes`` of logits (``None``: the plain loss)."""
        if chunk_bytes is not None and (isinstance(chunk_bytes, bool) or int(chunk_bytes) < 1):
            raise ValueError(f"{type(self).__name__}(loss_chunk_mib=...): a chunk needs a positive number of bytes, "
                             f"got {chunk_bytes!r}. Fix: loss_chunk_mib=128")
        self.loss_chunk_bytes = None if chunk_bytes is None else int(chunk_bytes)

    def head_inputs(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict[str, Any]]:
        """``(hidden, head weight, head bias, chunked_lm_loss keywords)`` for ``idx``: each model says its own."""
        raise NotImplementedError(f"{type(self).__name__} does not expose its LM head for the chunked loss")

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        if self.loss_chunk_bytes is not None:
            hidden, weight, bias, options = self.head_inputs(x)
            return lit_speed.chunked_lm_loss(hidden, weight, y, bias, chunk_bytes=self.loss_chunk_bytes,
                                             ignore_index=-100, **options)
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
