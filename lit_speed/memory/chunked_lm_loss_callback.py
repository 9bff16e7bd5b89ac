"""The LM head and cross-entropy in chunks for any LightningModule: the callback around
:func:`~lit_speed.memory.chunked_lm_loss.chunked_lm_loss`."""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lit_speed.interfaces import ChunkedLossModel
from lit_speed.memory.chunked_lm_loss import (
    DEFAULT_CHUNK_MIB,
    bytes_per_logit,
    chunk_tokens_for,
    chunked_lm_loss,
    compute_dtype,
)
from lit_speed.memory.hf_chunked_loss import (
    chunk_hf_loss,
    hf_lm_head,
    is_hf_causal_lm,
    set_chunk_bytes,
    unchunk_hf_loss,
)
from lit_speed.tuning.measured_choice import Decision, measured_choice, on_rank_zero

#: ``chunk_mib="auto"``: the largest chunk it tries, in MiB of logits (what the fit check counts for the loss).
AUTO_MAX_MIB = 1024
#: ``chunk_mib="auto"`` times the chunks on this many rows of the head (all of a smaller vocabulary).
AUTO_SLICE_ROWS = 8192
#: ``chunk_mib="auto"`` does not time when the default chunk already holds this many tokens (a small vocabulary).
AUTO_ENOUGH_TOKENS = 4096


def auto_chunk_candidates(vocab_size: int, compute: torch.dtype = torch.float32, softcap: bool = False) -> list[int]:
    """Tokens per chunk that ``chunk_mib="auto"`` times: the default budget's (:data:`DEFAULT_CHUNK_MIB`), then
    twice and four times as many while the logits stay within :data:`AUTO_MAX_MIB`; one candidate when the default
    chunk already holds :data:`AUTO_ENOUGH_TOKENS` tokens."""
    base = chunk_tokens_for(vocab_size, DEFAULT_CHUNK_MIB * 2**20, compute, softcap)
    if base >= AUTO_ENOUGH_TOKENS:
        return [base]
    cap = chunk_tokens_for(vocab_size, AUTO_MAX_MIB * 2**20, compute, softcap)
    return [base] + [base * k for k in (2, 4) if base * k <= cap]


def head_compute_dtype(context: Callable[[], contextlib.AbstractContextManager], hidden_dtype: torch.dtype,
                       device: torch.device) -> torch.dtype:
    """The dtype the head's matmuls run in for hidden states of ``hidden_dtype`` inside the run's forward context."""
    with context():
        return compute_dtype(torch.empty(0, dtype=hidden_dtype, device=device))


def choose_chunk_tokens(weight: torch.Tensor, options: dict[str, Any] | None = None,
                        context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                        hidden_dtype: torch.dtype | None = None) -> Decision:
    """Time the chunked loss's forward and backward at each of :func:`auto_chunk_candidates` on this machine and
    device, on the head's first :data:`AUTO_SLICE_ROWS` rows (a copy) and the same tokens for every candidate; keep
    the default's chunk unless a larger one is faster by the tuning margin (``lit_speed.tuning``, cached per machine).

    Why measured: a chunk's matmuls against a wide head run faster with more rows, by how much depends on the
    processor (151,936 x 896 head, Zen3: 220 rows ran the head's matmuls at 84 GFLOP/s, 883 rows at 111), and a
    larger chunk costs memory (:data:`AUTO_MAX_MIB` at most).

    Args:
        weight: The head's ``[vocab, hidden]`` weight, on the run's device; it is not changed.
        options: The model's logit transform (``logit_scale``, ``softcap``: ``LMHead.loss_options()``).
        context: The run's forward context (its autocast), so the matmuls run in the run's compute dtype.
        hidden_dtype: The dtype of the hidden states the head receives (default: the weight's, if floating).
    """
    options = dict(options or {})
    vocab, hidden = weight.shape
    rows = min(vocab, AUTO_SLICE_ROWS)
    with torch.no_grad():
        dtype = weight.dtype if weight.is_floating_point() else torch.float32
        head = weight[:rows].detach().to(dtype).clone().requires_grad_(weight.requires_grad)
    hidden_dtype = hidden_dtype or dtype
    compute = head_compute_dtype(context, hidden_dtype, weight.device)
    softcap = options.get("softcap") is not None
    candidates = auto_chunk_candidates(vocab, compute, softcap)
    key = {"vocab": vocab, "hidden": hidden, "weight_dtype": str(weight.dtype), "compute": str(compute),
           "hidden_dtype": str(hidden_dtype),
           "trains_head": weight.requires_grad, "softcap": softcap, "device": weight.device.type,
           **({"gpu": torch.cuda.get_device_name(weight.device)} if weight.device.type == "cuda" else {})}
    if len(candidates) == 1:
        return Decision("loss.chunk_tokens", str(candidates[0]),
                        f"the default chunk holds {candidates[0]} tokens (>= {AUTO_ENOUGH_TOKENS}): not timed",
                        {str(candidates[0]): None})
    tokens = candidates[-1]
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(tokens, hidden, generator=generator).to(weight.device, hidden_dtype).requires_grad_()
    targets = torch.randint(0, rows, (tokens,), generator=generator).to(weight.device)

    def run(chunk: int) -> Callable[[], None]:
        def step() -> None:
            with context():
                loss = chunked_lm_loss(states, head, targets, chunk_bytes=chunk * rows * bytes_per_logit(
                    compute, softcap), **options)
            loss.backward()
            states.grad = head.grad = None
            if weight.device.type == "cuda":
                torch.cuda.synchronize(weight.device)
        return step

    return measured_choice("loss.chunk_tokens", key, {str(c): run(c) for c in candidates}, str(candidates[0]))


class ChunkedLMLoss(Callback):
    """Compute the language-model loss in chunks of tokens, so that the logits of a large vocabulary (1.24 GB for
    4 x 512 tokens x 151,936 in float32) and their gradient never exist whole.

    At ``setup``: a module that implements :class:`~lit_speed.interfaces.ChunkedLossModel` (``GPTModule``,
    ``HFCausalLM``) switches its own loss; any other module gets every Hugging Face causal LM inside it wrapped, so
    that ``hf_model(input_ids, labels=...)`` returns the chunked loss (and ``logits=None``). Undone at ``teardown``.
    Loss and gradients equal the plain ones to float tolerance (``tests/memory/test_chunked_lm_loss.py``).

    Args:
        chunk_mib: Budget of one chunk's logits buffers in MiB; the chunk's token count follows from the vocabulary.
            ``"auto"`` (the default): at fit start, time chunks of the default budget's tokens and of 2x and 4x as
            many (up to :data:`AUTO_MAX_MIB`) on this machine and device (:func:`choose_chunk_tokens`) and keep the
            fastest; a resumed run keeps its checkpoint's chunk. Until fit starts (and in validate/test alone) the
            default budget, :data:`~lit_speed.memory.chunked_lm_loss.DEFAULT_CHUNK_MIB` MiB.
        check: Check on a few tokens that each Hugging Face model's logits are its head applied to its decoder's
            output (with the logit scaling or soft-capping its config declares) before wrapping it.

    Raises:
        ValueError: ``chunk_mib`` not positive; at setup, a module with nothing to chunk, or a Hugging Face model
            whose logits are more than its head (see :func:`~lit_speed.memory.hf_chunked_loss.hf_lm_head`).

    Example::

        trainer = Trainer(callbacks=[ChunkedLMLoss()])  # chunk_mib="auto": timed here; or a number of MiB
    """

    def __init__(self, chunk_mib: float | str = "auto", check: bool = True) -> None:
        self.auto = chunk_mib == "auto"
        if not self.auto and (isinstance(chunk_mib, bool) or not isinstance(chunk_mib, (int, float))
                              or not chunk_mib > 0):
            raise ValueError(f"ChunkedLMLoss(chunk_mib={chunk_mib!r}): the budget of one chunk's logits, a number of "
                             f"MiB > 0, or 'auto' (timed on this machine). Fix: chunk_mib=auto or "
                             f"chunk_mib={DEFAULT_CHUNK_MIB}")
        self.chunk_mib = float(DEFAULT_CHUNK_MIB if self.auto else chunk_mib)
        self.check = bool(check)
        self.decision: Decision | None = None  # chunk_mib="auto": what was timed (or restored) at fit start
        self._restored_mib: float | None = None
        self.wrapped: list[str] = []  # what the last setup switched (kept after teardown, for the summary)
        self.active = False

    @property
    def chunk_bytes(self) -> int:
        return max(1, int(self.chunk_mib * 2**20))

    def _apply(self, pl_module: "pl.LightningModule") -> None:
        """Give every wrapped module the current :attr:`chunk_bytes`."""
        if isinstance(pl_module, ChunkedLossModel):
            pl_module.use_chunked_loss(self.chunk_bytes)
        for module in pl_module.modules():
            set_chunk_bytes(module, self.chunk_bytes)

    @staticmethod
    def _head(pl_module: "pl.LightningModule") -> tuple[torch.Tensor | None, dict[str, Any]]:
        """The head's weight and logit transform of the (first) language model in ``pl_module``; no weight where it
        is not a whole ``[vocab, hidden]`` matrix here (a ZeRO-3 shard)."""
        weight, options = None, {}
        found = next((m for m in pl_module.modules() if is_hf_causal_lm(m)), None)
        if found is not None:
            spec = hf_lm_head(found, check=False)
            weight, options = spec.head.weight, spec.loss_options()
        else:
            weight = getattr(getattr(getattr(pl_module, "model", None), "lm_head", None), "weight", None)
        whole = isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.numel() > 0
        return (weight, options) if whole else (None, {})

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not (self.auto and self.active) or self.decision is not None:
            return
        weight, options = self._head(pl_module)
        if self._restored_mib is not None:
            self.chunk_mib = self._restored_mib
            self.decision = Decision("loss.chunk_tokens", "restored",
                                     f"{self.chunk_mib:g} MiB from the checkpoint: not timed", {})
        elif weight is not None:
            hidden_dtype = self._hidden_dtype(pl_module, weight)
            self.decision = on_rank_zero(lambda: choose_chunk_tokens(
                weight, options, trainer.precision_plugin.forward_context, hidden_dtype))
            tokens = int(self.decision.chosen)
            compute = head_compute_dtype(trainer.precision_plugin.forward_context, hidden_dtype, weight.device)
            self.chunk_mib = tokens * weight.shape[0] * bytes_per_logit(compute, options.get("softcap") is not None) \
                / 2**20
        else:
            return
        self._apply(pl_module)
        rank_zero_info(f"ChunkedLMLoss: chunk_mib=auto -> {self.chunk_mib:g} MiB of logits "
                       f"({self.decision.line()})")

    @staticmethod
    def _hidden_dtype(pl_module: "pl.LightningModule", weight: torch.Tensor) -> torch.dtype:
        """What the head's input is held in: the trainable weights' dtype (float32 adapters around a bf16 base, a
        bf16-true model's bf16), else the head's."""
        trained = next((p.dtype for p in pl_module.parameters() if p.requires_grad and p.is_floating_point()), None)
        return trained or (weight.dtype if weight.is_floating_point() else torch.float32)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"chunk_mib": self.chunk_mib} if self.auto and self.decision is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.auto and "chunk_mib" in state_dict:
            self._restored_mib = float(state_dict["chunk_mib"])

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
        rank_zero_info(f"ChunkedLMLoss: loss in chunks of {self.chunk_mib:g} MiB of logits ({', '.join(self.wrapped)})"
                       + ("; chunk_mib=auto times larger chunks at fit start" if self.auto else ""))

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if isinstance(pl_module, ChunkedLossModel):
            pl_module.use_chunked_loss(None)
        for module in pl_module.modules():
            unchunk_hf_loss(module)
        self.active = False

    def describe(self) -> dict[str, str]:
        where = ", ".join(self.wrapped) if self.wrapped else "set up at fit start"
        size = "auto (timed at fit start)" if self.auto and self.decision is None else f"<= {self.chunk_mib:g} MiB"
        return {"chunked loss": f"LM head + cross-entropy in chunks of {size} of logits ({where})"}

    def final_summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"chunk_mib": self.chunk_mib, "modules": list(self.wrapped)}
        if self.auto:
            out["auto"] = self.decision.line() if self.decision is not None else "not decided (no fit)"
        return out
