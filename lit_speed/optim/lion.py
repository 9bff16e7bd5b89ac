"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"): one state tensor instead of Adam's two.

Update per parameter ``p`` with gradient ``g`` and momentum ``m``::

    p <- p * (1 - lr * weight_decay)                       # decoupled weight decay
    p <- p - lr * sign(beta1 * m + (1 - beta1) * g)
    m <- beta2 * m + (1 - beta2) * g

Every coordinate moves by exactly ``lr``, so Lion wants a learning rate 3-10x smaller than AdamW's.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from lit_speed.optim.state_cost import whole_tensor_bytes


class Lion(torch.optim.Optimizer):
    """Lion optimizer: sign of an interpolated momentum; half of AdamW's optimizer-state memory.

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate (3-10x smaller than AdamW's for the same model).
        betas: ``(beta1, beta2)``: interpolation for the update and momentum decay, each in ``[0, 1)``.
        weight_decay: Decoupled weight decay (3-10x larger than AdamW's keeps ``lr * weight_decay`` the same).

    Raises:
        ValueError: ``lr`` or ``weight_decay`` is negative, or a beta is outside ``[0, 1)``.

    Example::

        optimizer = Lion(model.parameters(), lr=3e-4, weight_decay=0.1)
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        if lr < 0:
            raise ValueError(f"Lion(lr={lr}): lr must be >= 0, got {lr}")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"Lion(betas={tuple(betas)}): betas must be two values in [0, 1), got {tuple(betas)}")
        if weight_decay < 0:
            raise ValueError(f"Lion(weight_decay={weight_decay}): weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    def state_bytes_per_param(self, dtype: torch.dtype | None = None) -> float:
        """One momentum tensor like each parameter (``exp_avg``): half of AdamW's optimizer memory."""
        return whole_tensor_bytes([(self.param_groups, 1)], dtype)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, decay = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                m, g = state["exp_avg"], p.grad
                if decay:
                    p.mul_(1 - lr * decay)
                p.add_(torch.sign(m * beta1 + g * (1 - beta1)), alpha=-lr)
                m.lerp_(g, 1 - beta2)
        return loss
