"""``BatchedMuon``: ``torch.optim.Muon``'s update with the Newton-Schulz iterations batched over same-shape matrices.

torch's Muon (2.13) orthogonalises one matrix at a time: a 4-layer GPT has 16 hidden matrices, so one step is
16 x 5 iterations x 3 small bf16 matmuls, each paying Python and dispatch overhead. Transformer blocks repeat
the same shapes, so the matrices fall into a few buckets (per block: qkv, attention proj, MLP in, MLP out; the
two MLP matrices are the same shape once oriented wide); stacking each bucket turns the work into ``baddbmm``
calls over the whole bucket. The arithmetic per matrix is the same quintic iteration with the same
coefficients, in bf16 like torch's; the state (``momentum_buffer``) and the hyper-parameters are torch's, so a
checkpoint of either loads into the other.
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
    for _ in range(ns_steps):
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x


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
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], param.shape))
