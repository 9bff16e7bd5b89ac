"""The LM head and cross-entropy in chunks of tokens: the logits of a large vocabulary never exist whole.

For 4 x 512 tokens and a 151,936-token vocabulary the float32 logits alone are 1.24 GB, and the plain
``F.cross_entropy(lm_head(h))`` keeps about three such tensors alive (logits, log-softmax, their gradient).
:func:`chunked_lm_loss` takes the hidden states and the head's weight instead and, token chunk by token chunk,
computes the logits, a stable log-sum-exp (max subtracted, in place), the loss, and, in the same pass, the gradient
of the loss with respect to the hidden states (and to the head's weight and bias when they train): the chunk's
logits buffer becomes its gradient in place and is freed before the next chunk. Backward only multiplies the stored
gradients by the incoming scalar (a Liger-style fused linear cross-entropy, in plain torch).

Why gradients in forward rather than recomputed in backward: it runs the head's three matmuls once (logits, grad
of hidden, grad of weight) instead of four, for the same peak (the stored ``grad_hidden`` is tokens x hidden, e.g.
7 MB for 2048 x 896; a trainable head's gradient has to exist anyway). ``grads_in_forward=False`` recomputes instead
(it wastes nothing when the loss is never backpropagated); measured in the memory card.

The math of Hugging Face's ``ForCausalLMLoss``: logits in float32 for the loss (under autocast the matmuls run in
the autocast dtype, as ``lm_head`` would), ``ignore_index`` tokens skipped, the mean over the tokens that count, or
the sum divided by ``num_items_in_batch``; optional logit scaling (Cohere's ``logit_scale``, Granite's
``1 / logits_scaling``) and soft-capping (Gemma 2's ``final_logit_softcapping``).
"""
from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

#: Default budget for one chunk's logits buffers.
DEFAULT_CHUNK_MIB = 128
#: A 16-bit weight is cast to the compute dtype (or a float32 one to bf16 under autocast) in vocabulary slices of at
#: most this many bytes, never whole (a 151,936 x 896 head is 545 MB in float32).
SLICE_BYTES = 32 * 2**20
REDUCTIONS = ("mean", "sum")


def compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmuls run in: autocast's where it is on for ``hidden``'s device, else ``hidden``'s."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


def bytes_per_logit(compute: torch.dtype = torch.float32, softcap: bool = False) -> int:
    """Transient bytes per logit of a chunk: the float32 buffer, the 16-bit matmul output or gradient copy when the
    matmuls run in 16 bits, and the soft-cap's derivative."""
    return 4 + (compute.itemsize if compute != torch.float32 else 0) + (4 if softcap else 0)


def chunk_tokens_for(vocab_size: int, chunk_bytes: int, compute: torch.dtype = torch.float32,
                     softcap: bool = False) -> int:
    """Tokens per chunk so that a chunk's logits buffers stay within ``chunk_bytes`` (at least one token)."""
    return max(1, int(chunk_bytes) // (int(vocab_size) * bytes_per_logit(compute, softcap)))


def balanced_chunk(tokens: int, most: int) -> int:
    """Tokens per chunk when ``tokens`` are split into as few chunks of at most ``most`` as possible, of equal
    length: no short last chunk (a 64-row matmul against a 151,936 x 896 head ran at 42 GFLOP/s where 220 rows ran
    at 62-97 on a Zen3), never more than ``most``."""
    if tokens <= 0:
        return max(1, int(most))
    chunks = -(-int(tokens) // max(1, int(most)))
    return -(-int(tokens) // chunks)


def chunked_loss_bytes(tokens: int, vocab_size: int, hidden_size: int, chunk_bytes: int = DEFAULT_CHUNK_MIB * 2**20,
                       compute: torch.dtype = torch.float32, softcap: bool = False,
                       weight_trains: bool = False, weight_dtype: torch.dtype = torch.float32) -> int:
    """The most bytes :func:`chunked_lm_loss` allocates at once beyond its inputs (for a memory planner).

    One chunk's logits buffers, the float32 ``grad_hidden`` kept for backward, a cast slice of the weight when its
    dtype is not the compute dtype, and (``weight_trains``) the float32 gradient of the head's weight.
    Compare with the unchunked loss: about ``3 * tokens * vocab_size * 4`` bytes.
    """
    per_chunk = min(tokens, chunk_tokens_for(vocab_size, chunk_bytes, compute, softcap))
    logits = per_chunk * vocab_size * bytes_per_logit(compute, softcap)
    grad_hidden = 2 * tokens * hidden_size * 4  # the kept gradient and the chunk rows gathered
    cast = min(SLICE_BYTES, vocab_size * hidden_size * compute.itemsize) if weight_dtype != compute else 0
    return logits + grad_hidden + cast + (vocab_size * hidden_size * 4 if weight_trains else 0)


def _vocab_slices(vocab: int, hidden: int, itemsize: int, cast: bool) -> list[tuple[int, int]]:
    if not cast:
        return [(0, vocab)]
    rows = max(1, SLICE_BYTES // max(1, hidden * itemsize))
    return [(v, min(vocab, v + rows)) for v in range(0, vocab, rows)]


def _rows(weight: torch.Tensor, v0: int, v1: int, cdt: torch.dtype, weight_scale: torch.Tensor | None
          ) -> torch.Tensor:
    """Rows ``v0:v1`` of the head's weight in ``cdt``: a cast, or an int8-held weight dequantized."""
    rows = weight[v0:v1].to(cdt)
    return rows if weight_scale is None else rows * weight_scale[v0:v1].to(cdt)


class _Buffers:
    """One chunk's logits buffers, allocated once per call and reused by every chunk: the float32 logits (their
    gradient in place) and, for a 16-bit compute dtype, the matmul's output and the gradient's cast. A fresh
    tokens x vocabulary tensor per chunk paid its page faults each time (0.5B LoRA, 147 x 151,936: a bf16 -> float32
    cast into a new tensor 24.6 ms, into a reused one 6.3 ms, on a Xeon with AMX)."""

    def __init__(self, tokens: int, vocab: int, cdt: torch.dtype, device: torch.device) -> None:
        self.f32 = torch.empty(tokens, vocab, dtype=torch.float32, device=device)
        self.low = torch.empty(tokens, vocab, dtype=cdt, device=device) if cdt != torch.float32 else None

    def rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The float32 and 16-bit buffers for a chunk of ``n`` tokens (contiguous views)."""
        return self.f32[:n], None if self.low is None else self.low[:n]

    def vocab_major(self, n: int) -> torch.Tensor:
        """``[vocab, n]`` in the compute dtype over the same memory (the 16-bit buffer, or the float32 one when the
        compute dtype is float32): where a head cast slice by slice writes its output, no third buffer."""
        store = self.f32 if self.low is None else self.low
        return store.view(-1)[:store.shape[1] * n].view(store.shape[1], n)


def _head(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cdt: torch.dtype,
          slices: list[tuple[int, int]], buffers: _Buffers, weight_scale: torch.Tensor | None = None
          ) -> torch.Tensor:
    """float32 logits ``h @ weight.T + bias`` in ``buffers``, the matmul in ``cdt``, casting ``weight`` slice by
    slice."""
    hc = h.to(cdt)
    f32, low = buffers.rows(h.shape[0])
    if len(slices) == 1 and weight.dtype == cdt:
        out = torch.mm(hc, weight.t(), out=f32) if low is None else f32.copy_(torch.mm(hc, weight.t(), out=low))
    else:  # vocabulary-major: each cast slice of the weight fills a contiguous block of rows, written in place
        out_t = buffers.vocab_major(h.shape[0])
        for v0, v1 in slices:
            torch.mm(_rows(weight, v0, v1, cdt, weight_scale), hc.t(), out=out_t[v0:v1])
        out = out_t.t() if low is None else f32.copy_(out_t.t())
    if bias is not None:
        out += bias.float()
    return out


def _chunk(h: torch.Tensor, tgt: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cdt: torch.dtype,
           slices: list[tuple[int, int]], scale: float, softcap: float | None, grad_scale: float | None,
           grad_weight: torch.Tensor | None, want: tuple[bool, bool, bool], buffers: _Buffers,
           weight_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One chunk: the summed loss; with ``grad_scale``, the gradients ``want`` asks for: ``grad_h`` and the bias's
    (float32) returned, the weight's added into ``grad_weight`` (float32) in place."""
    logits = _head(h, weight, bias, cdt, slices, buffers, weight_scale)
    if scale != 1.0:
        logits.mul_(scale)
    deriv = None
    if softcap is not None:  # y = cap * tanh(z / cap); dy/dz = 1 - tanh^2
        logits.div_(softcap).tanh_()
        deriv = 1.0 - logits.square() if grad_scale is not None else None
        logits.mul_(softcap)
    rows = torch.arange(len(tgt), device=h.device)
    target_logit = logits[rows, tgt]
    top = logits.amax(dim=1, keepdim=True)
    total = logits.sub_(top).exp_().sum(dim=1, keepdim=True)  # in place: logits now hold exp(logit - max)
    loss = (total.log() + top).squeeze(1).sub_(target_logit).sum()
    if grad_scale is None:
        return loss, None, None
    grad = logits.div_(total)  # softmax, in place
    grad[rows, tgt] -= 1.0
    if deriv is not None:
        grad.mul_(deriv)
        del deriv
    grad.mul_(grad_scale * scale)  # d loss / d (h @ W.T + b)
    grad_bias = grad.sum(dim=0) if want[2] else None
    low = buffers.rows(len(tgt))[1]
    gc = grad.to(cdt) if low is None else low.copy_(grad)  # the logits' 16-bit buffer is free again
    grad_h = None
    if want[0] and len(slices) == 1 and weight.dtype == cdt:
        grad_h = (gc @ weight).float()
    elif want[0]:
        grad_h = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        for v0, v1 in slices:
            grad_h += gc[:, v0:v1] @ _rows(weight, v0, v1, cdt, weight_scale)
    if grad_weight is not None:
        hc = h.to(cdt)
        if cdt == torch.float32:
            grad_weight.addmm_(gc.t(), hc)  # in place: no vocab x hidden temporary
        else:
            for v0, v1 in _vocab_slices(weight.shape[0], weight.shape[1], cdt.itemsize, True):
                grad_weight[v0:v1] += gc[:, v0:v1].t() @ hc
    return loss, grad_h, grad_bias


def _run(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
         opts: dict[str, Any], grads: tuple[bool, bool, bool]) -> tuple[torch.Tensor, ...]:
    """The loss, and the gradients asked for by ``grads`` (hidden, weight, bias) for an incoming gradient of 1."""
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).to(h.device)
    chosen = (t != opts["ignore_index"]).nonzero().squeeze(1)
    count = int(chosen.numel())
    cdt = opts["compute"]
    if opts["num_items_in_batch"] is not None:
        divisor = float(opts["num_items_in_batch"])
    else:
        divisor = float(count) if opts["reduction"] == "mean" else 1.0
    grad_scale = (1.0 / divisor if divisor else 0.0) if any(grads) else None
    slices = _vocab_slices(weight.shape[0], weight.shape[1], cdt.itemsize, weight.dtype != cdt)
    step = balanced_chunk(count, chunk_tokens_for(weight.shape[0], opts["chunk_bytes"], cdt, opts["softcap"] is not None))
    grad_h = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if grads[0] else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if grads[1] else None
    grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=h.device) if grads[2] else None
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    buffers = _Buffers(min(step, count), weight.shape[0], cdt, h.device)
    for start in range(0, count, step):
        rows = chosen[start:start + step]
        part, gh, gb = _chunk(h[rows], t[rows], weight, bias, cdt, slices, opts["scale"], opts["softcap"],
                              grad_scale, grad_w, grads, buffers, opts.get("weight_scale"))
        loss += part
        if grad_h is not None and gh is not None:
            grad_h.index_add_(0, rows, gh)
        if grad_b is not None and gb is not None:
            grad_b += gb
    loss = loss / divisor  # a mean over no token is 0 / 0 = NaN, as F.cross_entropy's
    return (loss, None if grad_h is None else grad_h.reshape(hidden.shape).to(hidden.dtype),
            None if grad_w is None else grad_w.to(weight.dtype), None if grad_b is None else grad_b.to(bias.dtype))


class _StoredGradients(torch.autograd.Function):
    """Gradients computed in forward for an incoming gradient of 1; backward scales them."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                opts: dict[str, Any]) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            loss, *ctx.grads = _run(hidden, weight, bias, targets, opts, tuple(ctx.needs_input_grad[:3]))
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads, ctx.grads = ctx.grads, None  # handed over: nothing kept after backward
        scale = grad_loss.reshape(())
        # in place: the tensors are ours, and a trainable head's gradient is vocabulary x hidden
        return (*(None if g is None else g.mul_(scale.to(g.dtype)) for g in grads), None, None)


class _RecomputedGradients(torch.autograd.Function):
    """Forward computes the loss only; backward recomputes the chunks' logits for the gradients."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                opts: dict[str, Any]) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            loss = _run(hidden, weight, bias, targets, opts, (False, False, False))[0]
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.opts = opts
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets = ctx.saved_tensors
        with torch.autocast(hidden.device.type, enabled=False):
            grads = _run(hidden, weight, bias, targets, ctx.opts, tuple(ctx.needs_input_grad[:3]))[1:]
        scale = grad_loss.reshape(())
        return (*(None if g is None else g * scale.to(g.dtype) for g in grads), None, None)


def chunked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                    bias: torch.Tensor | None = None, *, chunk_bytes: int = DEFAULT_CHUNK_MIB * 2**20,
                    ignore_index: int = -100, reduction: str = "mean",
                    num_items_in_batch: int | float | torch.Tensor | None = None, logit_scale: float = 1.0,
                    softcap: float | None = None, grads_in_forward: bool = True,
                    weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T + bias`` against ``targets``, without the whole logits tensor.

    Equal to ``F.cross_entropy((hidden @ weight.T + bias).float().flatten(0, -2), targets.flatten(),
    ignore_index=ignore_index, reduction=reduction)`` (and its gradients) to float tolerance.

    Args:
        hidden: ``[..., hidden_size]`` final hidden states (after the last norm), any float dtype.
        weight: ``[vocab_size, hidden_size]`` head weight (tied to the embedding or not); float32, or 16-bit (a
            frozen low-precision base): cast to the compute dtype a slice at a time.
        targets: ``[...]`` target token ids, already aligned with ``hidden`` (shifted by the caller).
        bias: ``[vocab_size]`` head bias, if any.
        chunk_bytes: Budget of one chunk's logits buffers; the chunk length is derived from it and the vocabulary.
        ignore_index: Targets with this value count neither in the loss nor in the mean.
        reduction: ``mean`` (over the tokens that count) or ``sum``.
        num_items_in_batch: Hugging Face's semantics: the summed loss divided by this (a whole accumulation
            window's token count), whatever ``reduction`` says.
        logit_scale: Multiplies the logits (Cohere's ``logit_scale``; Granite's is ``1 / logits_scaling``).
        softcap: ``cap * tanh(logits / cap)`` before the softmax (Gemma 2's ``final_logit_softcapping``).
        grads_in_forward: Compute the gradients in the forward pass (3 head matmuls in all); ``False`` recomputes
            the logits in backward (4).
        weight_scale: ``[vocab_size, 1]`` float32 scales of an int8-held frozen ``weight`` (the head's
            ``held_weight_scale``, :mod:`lit_speed.finetune.frozen_base`): each slice is dequantized, ``q * scale``.

    Returns:
        The float32 scalar loss (NaN for a mean over no token, as ``F.cross_entropy``).

    Raises:
        ValueError: An unknown reduction, a non-positive ``chunk_bytes``, or mismatched shapes.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"chunked_lm_loss(reduction={reduction!r}): one of {', '.join(REDUCTIONS)} (a per-token "
                         "loss would be the whole tokens x vocabulary problem again). Fix: reduction='mean'")
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"chunked_lm_loss(chunk_bytes={chunk_bytes!r}): a positive number of bytes. Fix: "
                         f"chunk_bytes={DEFAULT_CHUNK_MIB * 2**20} ({DEFAULT_CHUNK_MIB} MiB)")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1] or hidden.shape[:-1] != targets.shape:
        raise ValueError(f"chunked_lm_loss: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and targets "
                         f"{tuple(targets.shape)} do not fit: hidden [..., H], weight [V, H], targets [...]")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"chunked_lm_loss(softcap={softcap!r}): a positive cap or None")
    opts = {"chunk_bytes": chunk_bytes, "ignore_index": ignore_index, "reduction": reduction,
            "num_items_in_batch": None if num_items_in_batch is None else float(num_items_in_batch),
            "scale": float(logit_scale), "softcap": None if softcap is None else float(softcap),
            "compute": compute_dtype(hidden), "weight_scale": weight_scale}
    if weight.dtype == torch.int8 and weight_scale is None:
        raise ValueError("chunked_lm_loss: an int8 head weight needs its weight_scale (the module's "
                         "held_weight_scale): without it the logits would be the raw int8 steps")
    tracked = [t for t in (hidden, weight, bias) if t is not None and t.requires_grad]
    if not (torch.is_grad_enabled() and tracked):  # evaluation: the loss only, no graph
        with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
            return _run(hidden, weight, bias, targets, opts, (False, False, False))[0]
    function = _StoredGradients if grads_in_forward else _RecomputedGradients
    return function.apply(hidden, weight, bias, targets, opts)
