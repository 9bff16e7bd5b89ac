"""The training and validation steps every next-token language model here shares (bundled GPT, Hugging Face)."""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch
import torch.nn.functional as F

import lit_speed  # the public names: chunked_lm_loss (lit_speed.memory)
from lit_speed.models.configure_optimizers import configure_optimizers


def right_padded(mask: torch.Tensor) -> bool:
    """Whether every row of an ``attention_mask`` is ones then zeros: a causal model's real positions never see
    such padding, so the mask need not be applied (the fast causal attention kernel stays in use)."""
    return bool((mask[:, 1:] <= mask[:, :-1]).all())


def batch_parts(batch: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``(inputs, targets, model keywords)`` of a ``(input, target)`` pair or of a token dict (``input_ids``,
    ``labels``, ``attention_mask``, ``position_ids``; :class:`~lit_speed.sft.SFTDataModule`'s batches).

    ``position_ids`` go to the model (packed rows: positions restart at each example, and Hugging Face keeps
    attention inside each); ``attention_mask`` only where it masks something a causal model would otherwise see
    (not right padding) and no ``position_ids`` stand for it.
    """
    if not isinstance(batch, Mapping):
        x, y = batch
        return x, y, {}
    extra = {"position_ids": batch["position_ids"]} if "position_ids" in batch else {}
    mask = batch.get("attention_mask")
    if mask is not None and not extra and not right_padded(mask):
        extra["attention_mask"] = mask
    return batch["input_ids"], batch["labels"], extra


class NextTokenSteps:
    """Mixin for a LightningModule whose ``forward(idx)`` returns logits and whose batches are ``(input, target)``
    token windows (or token dicts, see :func:`batch_parts`): float32 cross-entropy (targets ``-100`` ignored),
    ``train/loss``, ``val/loss`` (per target token over the whole validation, all processes) and ``val/ppl``, and
    the optimizer over ``self.model`` from ``self.optimizer_factory`` / ``self.scheduler_factory``.

    With :meth:`use_chunked_loss` (``lit_speed.interfaces.ChunkedLossModel``) the loss runs the LM head and the
    cross-entropy in chunks of tokens (``lit_speed.chunked_lm_loss``) on what ``head_inputs(idx)`` returns: the final
    hidden states, the head's weight and bias, and the logit transform.

    Lightning's sanity check (``num_sanity_val_steps``) runs the validation step on the first row of each batch (one
    with a trained target): the code path it checks, at a fraction of a batch's cost (its values are never logged).
    At Qwen2.5-0.5B dims a 4 x 256 batch took 4.7 s, more than a third of a training step."""

    monitor = "val/loss"
    monitor_mode = "min"
    loss_chunk_bytes: int | None = None
    _val_sums: torch.Tensor | None = None  # summed token losses and tokens of the validation running now

    def use_chunked_loss(self, chunk_bytes: int | None) -> None:
        """Compute the loss in chunks of at most ``chunk_bytes`` of logits (``None``: the plain loss)."""
        if chunk_bytes is not None and (isinstance(chunk_bytes, bool) or int(chunk_bytes) < 1):
            raise ValueError(f"{type(self).__name__}(loss_chunk_mib=...): a chunk needs a positive number of bytes, "
                             f"got {chunk_bytes!r}. Fix: loss_chunk_mib=128")
        self.loss_chunk_bytes = None if chunk_bytes is None else int(chunk_bytes)

    def head_inputs(self, idx: torch.Tensor, **model_kwargs: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict[str, Any]]:
        """``(hidden, head weight, head bias, chunked_lm_loss keywords)`` for ``idx``: each model says its own."""
        raise NotImplementedError(f"{type(self).__name__} does not expose its LM head for the chunked loss")

    def batch_loss(self, batch: Any) -> torch.Tensor:
        """The mean loss over the trained targets of ``batch`` (a pair or a token dict), as ``training_step`` takes it."""
        x, y, extra = batch_parts(batch)
        if self.loss_chunk_bytes is not None:
            hidden, weight, bias, options = self.head_inputs(x, **extra)
            if isinstance(batch, Mapping):  # masked prompts and padding need no logits: the head sees trained positions
                keep = y != -100
                hidden, y = hidden[keep], y[keep]
            return lit_speed.chunked_lm_loss(hidden, weight, y, bias, chunk_bytes=self.loss_chunk_bytes,
                                             ignore_index=-100, **options)
        logits = self(x, **extra)
        # the loss in float32 under autocast: log-softmax over the vocabulary is where low precision hurts
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1), ignore_index=-100)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.batch_loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def on_validation_epoch_start(self) -> None:
        self._val_sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # summed token losses, tokens

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self._trainer is not None and self._trainer.sanity_checking:
            row = lit_speed.head_batch(batch, 1)
            batch = row if bool((batch_parts(row)[1] != -100).any()) else batch
        targets = batch_parts(batch)[1]
        tokens = (targets != -100).sum()
        self._val_sums += torch.stack([self.batch_loss(batch).detach().double() * tokens, tokens.double()])

    def on_validation_epoch_end(self) -> None:
        """``val/loss`` per target token over every batch of every process, and its exponential ``val/ppl``: a
        mean of batch means would weigh a short batch like a long one (and, without a reduction, one process's
        batches only)."""
        sums, self._val_sums = self._val_sums, None
        if sums is None or not float(sums[1]):
            return
        total, tokens = self.trainer.strategy.reduce(sums, reduce_op="sum").tolist()
        loss = total / tokens
        # already reduced: sync_dist averages equal values (and tells Lightning the value is the processes' own)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        self.log("val/ppl", math.exp(min(loss, 50.0)), sync_dist=True)  # exp(50): past any useful perplexity, not inf

    def configure_optimizers(self) -> Any:
        return configure_optimizers(self.model, self.optimizer_factory, self.scheduler_factory,
                                    self.hparams.weight_decay, self.trainer.estimated_stepping_batches,
                                    self.trainer.strategy)
