"""``BatchedMuon``: ``torch.optim.Muon``'s update with the Newton-Schulz iterations batched over same-shape matrices.

torch's Muon (2.13) orthogonalises one matrix at a time: a 4-layer GPT has 16 hidden matrices, so one step is
16 x 5 iterations x 3 small bf16 matmuls, each paying Python and dispatch overhead. Transformer blocks repeat
the same shapes, so the matrices fall into a few buckets (per block: qkv, attention proj, MLP in, MLP out; the
two MLP matrices are the same shape once oriented wide); stacking each bucket turns the work into ``baddbmm``
calls over the whole bucket. The arithmetic per matrix is the same quintic iteration with the same
coefficients, in bf16 like torch's; the state (``momentum_buffer``) and the hyper-parameters are torch's, so a
checkpoint of either loads into the other.

In float32 (``ns_dtype="float32"``, what ``auto`` picks on a CPU without native bf16) a wide bucket runs the same
iteration in its Gram form (:func:`gram_flops`): every ``p(A)`` is a polynomial in ``A0 = X0 X0^T``, so the
iteration can stay in ``rows x rows`` space and touch the wide ``X`` twice instead of twice per iteration. Same
polynomial, same result up to float32 rounding: 1e-5 to 4e-4 of the update (the standard float32 iteration's
~1e-6; torch's bf16 iteration's ~1e-2); fewer FLOPs when the matrix is more than 1.5x as wide as tall (an MLP's
4x: 44% fewer).
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Callable

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.optim import Muon

from lit_speed.optim.kernel_choice import NS_DTYPES
from lit_speed.optim.state_cost import whole_tensor_bytes

#: ``ns_dtype`` values: a dtype name (the ones :func:`~lit_speed.optim.kernel_choice.choose_ns_dtype` times), or
#: ``"auto"`` (timed on this machine).
NS_DTYPE_CHOICES = (*NS_DTYPES, "auto")


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's per-shape LR rule (torch 2.13): ``original`` (default) or ``match_rms_adamw``."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def newton_schulz_batched(updates: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                          eps: float, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Orthogonalise a stack ``(n, rows, cols)`` with ``rows <= cols``; torch's quintic iteration per matrix.

    Args:
        updates: Momentum updates, already oriented so that each matrix is wide.
        ns_coefficients: The ``(a, b, c)`` of the quintic.
        ns_steps: Iterations.
        eps: Floor of each matrix's norm.
        dtype: The iteration's dtype: bfloat16 as torch's Muon, or float32 where bf16 matmuls are slow.

    Returns:
        The orthogonalised stack in ``dtype``.
    """
    a, b, c = ns_coefficients
    x = updates.to(dtype)
    x = x / x.norm(dim=(1, 2), keepdim=True).clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    rows, cols = x.shape[-2:]
    if use_gram_form(rows, cols, ns_steps, dtype):
        return _gram_newton_schulz(x, a, b, c, ns_steps)
    return _standard_newton_schulz(x, a, b, c, ns_steps)


def _standard_newton_schulz(x: Tensor, a: float, b: float, c: float, ns_steps: int) -> Tensor:
    """torch's iteration on a normalised wide stack: ``X <- aX + (bA + cA^2) X`` with ``A = X X^T``."""
    for _ in range(ns_steps):
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x


def gram_flops(rows: int, cols: int, ns_steps: int) -> tuple[int, int]:
    """Multiply-add FLOPs of one matrix's iteration: ``(standard, Gram form)``.

    Standard, per iteration: ``A = X X^T`` (2 r^2 c), ``bA + cA^2`` (2 r^3), ``p(A) X`` (2 r^2 c). Gram form: ``A0``
    once (2 r^2 c); per iteration ``p(A)`` (2 r^3), ``Q <- p(A) Q`` (2 r^3, not the first), ``A <- p(A) A p(A)``
    (4 r^3, not the last); ``Q X0`` once (2 r^2 c).
    """
    r, c, k = rows, cols, ns_steps
    return k * (4 * r * r * c + 2 * r ** 3), 4 * r * r * c + (8 * k - 6) * r ** 3


def use_gram_form(rows: int, cols: int, ns_steps: int, dtype: torch.dtype) -> bool:
    """The Gram form where it costs fewer FLOPs, in float32/float64 only: ``Q`` grows up to ``a^steps`` (~480) on
    near-zero singular directions, which float32's 24 bits absorb and bf16's 8 would not."""
    standard, gram = gram_flops(rows, cols, ns_steps)
    return dtype in (torch.float32, torch.float64) and ns_steps > 1 and gram < standard


def _gram_newton_schulz(x: Tensor, a: float, b: float, c: float, ns_steps: int) -> Tensor:
    """``newton_schulz_batched``'s iteration in ``rows x rows`` space: X_k = Q_k X_0 with Q_k = p(A_{k-1})...p(A_0),
    and A_{k+1} = X_{k+1} X_{k+1}^T = p(A_k) A_k p(A_k) (p(A_k) is symmetric and commutes with A_k)."""
    gram = torch.bmm(x, x.mT)
    q: Tensor | None = None
    for k in range(ns_steps):
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        poly.diagonal(dim1=1, dim2=2).add_(a)  # aI + bA + cA^2
        q = poly if q is None else torch.bmm(poly, q)
        if k < ns_steps - 1:
            gram = torch.bmm(torch.bmm(poly, gram), poly)
    assert q is not None
    return torch.bmm(q, x)


class BatchedMuon(Muon):
    """``torch.optim.Muon`` with one batched Newton-Schulz per bucket of same-shape matrices.

    Same constructor, hyper-parameters, state and math as ``torch.optim.Muon`` (see its documentation); only
    the grouping of the matrix products differs, so results agree with torch's to bf16 rounding.

    One addition: ``ns_dtype``, the dtype of the Newton-Schulz iteration: ``"bfloat16"`` (torch's), ``"float32"``,
    or ``"auto"``: timed once on this machine on the optimizer's own bucket shapes before the first step
    (:func:`~lit_speed.optim.kernel_choice.choose_ns_dtype`, cached per machine; rank 0 decides for all). The
    choice is kept in every param group, so a checkpoint carries it and a resume does not time again.

    Example::

        opt = BatchedMuon([p for p in model.parameters() if p.ndim == 2], lr=0.02, ns_dtype="auto")
    """

    def __init__(self, params: Any, *args: Any, ns_dtype: str = "bfloat16", **kwargs: Any) -> None:
        if ns_dtype not in NS_DTYPE_CHOICES:
            raise ValueError(f"BatchedMuon(ns_dtype={ns_dtype!r}): ns_dtype must be one of {NS_DTYPE_CHOICES}, "
                             f"got {ns_dtype!r}")
        super().__init__(params, *args, **kwargs)
        self.defaults["ns_dtype"] = ns_dtype
        for group in self.param_groups:
            group.setdefault("ns_dtype", ns_dtype)
        self.ns_decision: Any = None  # the Decision of ns_dtype="auto", once made in this process

    def state_bytes_per_param(self, dtype: torch.dtype | None = None) -> float:
        """One momentum buffer like each matrix (``momentum_buffer``, as torch's Muon)."""
        return whole_tensor_bytes([(self.param_groups, 1)], dtype)

    def resolve_ns_dtype(self) -> None:
        """Decide ``ns_dtype="auto"`` now (see the class docstring); nothing when every group has a dtype."""
        if not any(g.get("ns_dtype") == "auto" for g in self.param_groups):
            return
        from lit_speed.optim.kernel_choice import choose_ns_dtype
        from lit_speed.tuning.measured_choice import on_rank_zero

        counts: dict[tuple[int, int], int] = defaultdict(int)
        group = next(g for g in self.param_groups if g["params"])
        for g in self.param_groups:
            for p in g["params"]:
                counts[(min(p.shape), max(p.shape))] += 1
        shapes = [(n, rows, cols) for (rows, cols), n in sorted(counts.items())]
        device = group["params"][0].device
        coefficients, steps = group["ns_coefficients"], group["ns_steps"]

        def orthogonalise(stack: Tensor, dtype: torch.dtype) -> Tensor:
            return newton_schulz_batched(stack, coefficients, steps, 1e-7, dtype)

        self.ns_decision = on_rank_zero(lambda: choose_ns_dtype(shapes, orthogonalise, device,
                                                                key={"steps": steps}))
        for g in self.param_groups:
            if g.get("ns_dtype") == "auto":
                g["ns_dtype"] = self.ns_decision.chosen
        rank_zero_info(f"Muon: {self.ns_decision.line()}")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # noqa: D102 - torch.optim.Muon.step
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.resolve_ns_dtype()
        for group in self.param_groups:
            params: list[Tensor] = []
            grads: list[Tensor] = []
            bufs: list[Tensor] = []
            self._init_group(group, params, grads, bufs)
            self._update_group(group, params, grads, bufs)
        return loss

    @staticmethod
    def _update_group(group: dict[str, Any], params: list[Tensor], grads: list[Tensor], bufs: list[Tensor]) -> None:
        momentum, lr = group["momentum"], float(group["lr"])
        buckets: dict[tuple[Any, ...], list[int]] = defaultdict(list)
        updates: list[Tensor] = []
        for i, (grad, buf) in enumerate(zip(grads, bufs)):
            if grad.ndim != 2:
                raise ValueError(f"Muon updates 2-D matrices only; got a parameter of shape {tuple(grad.shape)}")
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            tall = update.size(0) > update.size(1)
            updates.append(update.T if tall else update)
            buckets[(tuple(updates[-1].shape), update.dtype, update.device)].append(i)
        for idx in buckets.values():
            ortho = newton_schulz_batched(torch.stack([updates[i] for i in idx]), group["ns_coefficients"],
                                          group["ns_steps"], group["eps"], getattr(torch, group.get("ns_dtype",
                                                                                                   "bfloat16")))
            for j, i in enumerate(idx):
                param = params[i]
                update = ortho[j].T if param.size(0) > param.size(1) else ortho[j]
                if group["weight_decay"]:  # x 1.0 would be a no-op pass over the matrix
                    param.mul_(1 - lr * group["weight_decay"])
                param.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], param.shape))
