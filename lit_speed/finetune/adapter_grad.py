"""LoRA's up-projection with its weight gradient as ``(h^T dY)^T``: the same sums as ``nn.Linear``'s ``dY^T h``,
with the rank as the matmul's row count instead of its column count; which one is faster is timed where it runs.

LoRA's up-projection ``lora_B`` is an ``nn.Linear(r, width)``: ``y = h @ B^T`` with ``h`` of ``tokens x r``.
Autograd computes its weight gradient as ``dY^T @ h``, a ``width x tokens x r`` matmul whose output has ``r``
columns. MKL's float32 GEMM is slow at that shape: on a Zen3 (2 cores, torch 2.13's MKL 2024.2), ``[4864, 2048] x
[2048, 8]`` took 40-86 ms where ``[8, 2048] x [2048, 4864]`` (the same products, transposed) took 9.7 ms, and in a
profiled LoRA step of the Qwen2.5-0.5B-dims model (r=8, 4 x 512 tokens) that one gradient was 37 ms per MLP
projection, 1.3-1.8 s of a ~45 s step over 24 layers. ``transposed`` computes ``(h^T @ dY)^T`` instead; the input
gradient ``dY @ B`` and the forward stay as they are. The sums are the same (the summation order inside the GEMM
may differ, as between any two BLAS kernels).

Which is faster depends on the BLAS and the CPU (or GPU), so ``auto`` times both on the model's widest adapter at
the run's tokens per micro-batch (:func:`choose_up_grad`, ``lit_speed.tuning.measured_choice``: interleaved, cached
per machine and shape) and keeps ``standard`` unless ``transposed`` is faster by the usual margin.

Only ``peft``'s LoRA up-projections that are plain ``nn.Linear`` change, to the subclass :class:`TransposedUpLinear`
in place (parameters, ``state_dict`` keys, ``peft``'s merge and the export are untouched); ``standard`` puts
``nn.Linear`` back.
Under DeepSpeed ZeRO stage 3 (which gathers partitioned weights through its own ``F.linear`` autograd function)
it is not used.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from lit_speed.tuning import Decision, measured_choice

UP_GRADS = ("auto", "standard", "transposed")


class _RankRowsGrad(torch.autograd.Function):
    """``h @ W^T + b`` whose weight gradient is ``(h^T @ dY)^T`` (``nn.Linear``'s is ``dY^T @ h``)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(h, weight)
        ctx.has_bias = bias is not None
        return F.linear(h, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        h, weight = ctx.saved_tensors
        grad_h = grad @ weight if ctx.needs_input_grad[0] else None
        rows = grad.reshape(-1, grad.shape[-1])
        grad_w = (h.reshape(-1, h.shape[-1]).t() @ rows).t() if ctx.needs_input_grad[1] else None
        grad_b = rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_h, grad_w, grad_b


class TransposedUpLinear(nn.Linear):
    """An ``nn.Linear`` whose weight gradient is ``(h^T dY)^T``; :func:`set_up_grad` gives an up-projection this class
    in place (its parameters, ``state_dict`` and ``isinstance(m, nn.Linear)`` stay). A class, not a ``forward``
    replaced per instance: ``torch.compile`` guards on a per-instance ``forward``'s identity, so each decoder layer
    was compiled again until the recompile limit (8) left the rest eager (0.5B dims, Z3: +0.6 GB of saved activations,
    +30-40 s in the first step). Under autocast it casts as autocast casts ``F.linear``."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        device = h.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            with torch.autocast(device, enabled=False):
                return _RankRowsGrad.apply(h.to(dtype), self.weight.to(dtype),
                                           None if self.bias is None else self.bias.to(dtype))
        return _RankRowsGrad.apply(h, self.weight, self.bias)


def up_projections(model: nn.Module) -> list[nn.Linear]:
    """``peft``'s LoRA up-projections (``lora_B``) in ``model`` that are plain ``nn.Linear`` (or already
    :class:`TransposedUpLinear`)."""
    found = []
    for module in model.modules():
        ups = getattr(module, "lora_B", None)
        if isinstance(ups, nn.ModuleDict):
            found += [up for up in ups.values() if type(up) in (nn.Linear, TransposedUpLinear)]
    return found


def set_up_grad(model: nn.Module, mode: str) -> int:
    """Compute the up-projections' weight gradients ``standard`` (``nn.Linear``) or ``transposed``; returns how many
    modules are in that mode now."""
    if mode not in UP_GRADS[1:]:
        raise ValueError(f"set_up_grad(mode={mode!r}): one of {', '.join(UP_GRADS[1:])} (auto is decided by "
                         "choose_up_grad)")
    ups = up_projections(model)
    for up in ups:
        up.__class__ = TransposedUpLinear if mode == "transposed" else nn.Linear
    return len(ups)


def _widest(model: nn.Module) -> tuple[int, int] | None:
    shapes = [tuple(up.weight.shape) for up in up_projections(model)]
    return max(shapes, key=lambda s: s[0] * s[1]) if shapes else None


def choose_up_grad(model: nn.Module, device: torch.device | str = "cpu", tokens: int = 2048,
                   dtype: torch.dtype = torch.float32, measure: Callable[..., Decision] = measured_choice) -> Decision:
    """``standard`` or ``transposed`` for ``model``'s up-projections: the weight gradient of its widest one, with
    ``tokens`` rows in ``dtype`` on ``device``, timed both ways (``measure``, cached per machine and shape)."""
    device = torch.device(device)
    name = "peft.up_grad"
    shape = _widest(model)
    if shape is None:
        return Decision(name, "standard", "no LoRA up-projection (nn.Linear) to time")
    width, rank = shape
    gen = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(tokens, rank, generator=gen).to(device, dtype)
    grad = torch.randn(tokens, width, generator=gen).to(device, dtype)

    def run(mode: str) -> Callable[[], Any]:
        def call() -> None:
            _ = grad.t() @ h if mode == "standard" else (h.t() @ grad).t()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return call

    return measure(name, {"shape": [width, rank], "tokens": tokens, "device": device.type, "dtype": str(dtype)},
                   {"standard": run("standard"), "transposed": run("transposed")}, default="standard")


__all__ = ["UP_GRADS", "TransposedUpLinear", "choose_up_grad", "set_up_grad", "up_projections"]
