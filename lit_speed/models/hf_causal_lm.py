"""A Hugging Face causal language model (``AutoModelForCausalLM``) as a LightningModule.

``python scripts/train.py model=hf_causal_lm data=text_folder model.pretrained=<folder or hub id> data.root=<texts>``

The model trains on the same ``(input, target)`` token windows as the bundled GPT, so every lit_speed component
applies unchanged: precision modes, accumulation (token-normalised too), ZeRO, activation checkpointing by block
class (``LlamaDecoderLayer``, ``GPT2Block``), device stats, fault tolerance, adapters (``peft=lora``).
Needs the ``finetune`` extra (``pip install -e ".[finetune]"``: transformers, peft, safetensors).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from lit_speed.models.optim import configure_optimizers


def _needs_transformers(owner: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise ValueError(f"{owner}: needs the transformers package. Fix: pip install -e \".[finetune]\" "
                         "(or bash scripts/run.sh setup)") from None
    return transformers


def load_tokenizer(pretrained: str, owner: str = "HFCausalLM") -> Any:
    """``AutoTokenizer.from_pretrained(pretrained)`` with a one-line error naming the setting."""
    transformers = _needs_transformers(f"{owner}(pretrained={pretrained})")
    try:
        return transformers.AutoTokenizer.from_pretrained(pretrained)
    except (OSError, ValueError) as error:
        raise ValueError(f"{owner}(pretrained={pretrained}): no tokenizer there "
                         f"({' '.join(str(error).split())[:200]}). Fix: a save_pretrained folder with tokenizer files, "
                         "or a hub id (needs network access)") from None


class HFCausalLM(pl.LightningModule):
    """Next-token training of any ``AutoModelForCausalLM``.

    Args:
        pretrained: A ``save_pretrained`` folder or a hub id (downloaded by ``transformers``: needs network).
        from_config: Build the architecture of ``pretrained`` with fresh random weights instead of its weights.
        optimizer: Factory ``params -> Optimizer`` (a Hydra ``_partial_``).
        scheduler: Optional factory ``(optimizer, total_steps) -> LRScheduler``.
        weight_decay: On matrices and embeddings only (0 is usual for fine-tuning).
        attn_implementation: ``sdpa`` (default), ``eager``, or what ``transformers`` offers for the model.

    Raises:
        ValueError: ``pretrained`` is neither a model folder nor a hub id that can be fetched.

    Example::

        model = HFCausalLM("path/to/folder", optimizer=functools.partial(torch.optim.AdamW, lr=1e-4))
    """

    monitor = "val/loss"
    monitor_mode = "min"

    def __init__(self, pretrained: str, from_config: bool = False,
                 optimizer: Callable[..., torch.optim.Optimizer] | None = None,
                 scheduler: Callable[..., Any] | None = None, weight_decay: float = 0.0,
                 attn_implementation: str | None = "sdpa") -> None:
        super().__init__()
        owner = f"HFCausalLM(pretrained={pretrained})"
        transformers = _needs_transformers(owner)
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
        try:
            if from_config:
                config = transformers.AutoConfig.from_pretrained(pretrained)
                self.model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
            else:  # float32 weights: the precision plugin decides the compute dtype
                self.model = transformers.AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32, **kwargs)
        except (OSError, ValueError) as error:
            where = "a folder without a model" if Path(pretrained).expanduser().is_dir() else \
                "not a local folder, and not fetched from the hub (offline, or no such id)"
            raise ValueError(f"{owner}: {where} ({' '.join(str(error).split())[:200]}). Fix: model.pretrained=<a "
                             "save_pretrained folder>, or a hub id with network access") from None
        try:  # saved next to an exported model (the DataModule loads its own copy to tokenize)
            self.tokenizer = load_tokenizer(pretrained)
        except ValueError:
            self.tokenizer = None
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx, use_cache=False).logits

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        # the loss in float32 under autocast, as for the bundled GPT
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
