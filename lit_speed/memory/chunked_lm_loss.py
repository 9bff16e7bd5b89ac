"""The LM head and cross-entropy in chunks for any LightningModule: the callback around
:func:`~lit_speed.memory.chunked_cross_entropy.chunked_lm_loss`."""
from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lit_speed.interfaces import ChunkedLossModel
from lit_speed.memory.chunked_cross_entropy import DEFAULT_CHUNK_MIB
from lit_speed.memory.hf_chunked_loss import chunk_hf_loss, is_hf_causal_lm, unchunk_hf_loss


class ChunkedLMLoss(Callback):
    """Compute the language-model loss in chunks of tokens, so that the logits of a large vocabulary (1.24 GB for
    4 x 512 tokens x 151,936 in float32) and their gradient never exist whole.

    At ``setup``: a module that implements :class:`~lit_speed.interfaces.ChunkedLossModel` (``GPTModule``,
    ``HFCausalLM``) switches its own loss; any other module gets every Hugging Face causal LM inside it wrapped, so
    that ``hf_model(input_ids, labels=...)`` returns the chunked loss (and ``logits=None``). Undone at ``teardown``.
    Loss and gradients equal the plain ones to float tolerance (``tests/memory/test_chunked_loss.py``).

    Args:
        chunk_mib: Budget of one chunk's logits buffers in MiB; the chunk's token count follows from the vocabulary.
        check: Check on a few tokens that each Hugging Face model's logits are its head applied to its decoder's
            output (with the logit scaling or soft-capping its config declares) before wrapping it.

    Raises:
        ValueError: ``chunk_mib`` not positive; at setup, a module with nothing to chunk, or a Hugging Face model
            whose logits are more than its head (see :func:`~lit_speed.memory.hf_chunked_loss.hf_lm_head`).

    Example::

        trainer = Trainer(callbacks=[ChunkedLMLoss(chunk_mib=128)])
    """

    def __init__(self, chunk_mib: float = DEFAULT_CHUNK_MIB, check: bool = True) -> None:
        if isinstance(chunk_mib, bool) or not isinstance(chunk_mib, (int, float)) or not chunk_mib > 0:
            raise ValueError(f"ChunkedLMLoss(chunk_mib={chunk_mib!r}): the budget of one chunk's logits, a number of "
                             f"MiB > 0. Fix: chunk_mib={DEFAULT_CHUNK_MIB} (64-256 is usual)")
        self.chunk_mib = float(chunk_mib)
        self.check = bool(check)
        self.wrapped: list[str] = []  # what the last setup switched (kept after teardown, for the summary)
        self.active = False

    @property
    def chunk_bytes(self) -> int:
        return max(1, int(self.chunk_mib * 2**20))

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if self.active:
            return
        if isinstance(pl_module, ChunkedLossModel):
            pl_module.use_chunked_loss(self.chunk_bytes)
            self.wrapped = [type(pl_module).__name__]
        else:
            found = [(name, m) for name, m in pl_module.named_modules() if is_hf_causal_lm(m)]
            for name, module in found:
                chunk_hf_loss(module, self.chunk_bytes, check=self.check)
            self.wrapped = [name or type(pl_module).__name__ for name, _ in found]
        if not self.wrapped:
            raise ValueError(f"ChunkedLMLoss: {type(pl_module).__name__} holds no Hugging Face causal LM and has no "
                             "use_chunked_loss(chunk_bytes) method (lit_speed.interfaces.ChunkedLossModel): there is "
                             "no language-model loss to chunk. Fix: drop chunked_loss from callbacks")
        self.active = True
        rank_zero_info(f"ChunkedLMLoss: loss in chunks of {self.chunk_mib:g} MiB of logits ({', '.join(self.wrapped)})")

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if isinstance(pl_module, ChunkedLossModel):
            pl_module.use_chunked_loss(None)
        for module in pl_module.modules():
            unchunk_hf_loss(module)
        self.active = False

    def describe(self) -> dict[str, str]:
        where = ", ".join(self.wrapped) if self.wrapped else "set up at fit start"
        return {"chunked loss": f"LM head + cross-entropy in chunks of <= {self.chunk_mib:g} MiB of logits ({where})"}

    def final_summary(self) -> dict[str, Any]:
        return {"chunk_mib": self.chunk_mib, "modules": list(self.wrapped)}
