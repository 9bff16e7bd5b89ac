"""Optimizer kernels chosen by timing them on this machine, on the shapes of the run's own parameters.

Two choices that change speed and not the math (beyond float rounding), and whose best value depends on the CPU:

- **AdamW's kernel** (``fused``, ``foreach`` or the per-parameter ``for-loop``): fused AdamW stepped 25M
  parameters ~4x faster than foreach on a Zen3 (MEASUREMENTS.md), but a kernel's edge depends on the tensor count
  and sizes and on the CPU's vector units.
- **Muon's Newton-Schulz dtype** (``bfloat16``, as torch's Muon, or ``float32``): bf16 matmuls ran 2-6x faster than
  fp32 on an AVX512-BF16 Zen4 and an AMX Xeon, and 57-507x *slower* on a Zen3 without bf16 kernels.

Each is declared here, next to the optimizers that use it, and decided once per machine and parameter layout by
:func:`lit_speed.tuning.measured_choice` (the one timing method: interleaved, one margin, cached per machine), on
copies: the run's own parameters, gradients and optimizer state are not touched.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from lit_speed.compat.torch import cpu_has_native_bf16
from lit_speed.tuning.measured_choice import Decision, measured_choice

ADAMW_KERNELS = ("fused", "foreach", "for-loop")
NS_DTYPES = ("bfloat16", "float32")
#: Most parameter elements copied to time AdamW's kernels (3 copies per candidate: param, grad, state).
ADAMW_PROBE_ELEMENTS = 4_000_000


def adamw_flags(kernel: str) -> dict[str, bool]:
    """``torch.optim.AdamW``'s ``fused``/``foreach`` arguments for a kernel name."""
    if kernel not in ADAMW_KERNELS:
        raise ValueError(f"kernel must be one of {ADAMW_KERNELS} or 'auto', got {kernel!r}")
    return {"fused": kernel == "fused", "foreach": kernel == "foreach"}


def probe_tensors(params: Sequence[Tensor], max_elements: int = ADAMW_PROBE_ELEMENTS) -> list[Tensor]:
    """Fresh tensors shaped like ``params`` (their dtypes and device), the first ones up to ``max_elements``
    elements in all (at least one): the kernels' per-tensor and per-element costs, at bounded memory."""
    out: list[Tensor] = []
    total = 0
    for p in params:
        if out and total + p.numel() > max_elements:
            break
        out.append(torch.randn(p.shape, dtype=p.dtype, device=p.device))
        total += p.numel()
    return out


def _adamw_step(like: Sequence[Tensor], kernel: str) -> Callable[[], None]:
    params = [torch.nn.Parameter(t.clone()) for t in like]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-6, **adamw_flags(kernel))
    return opt.step


def choose_adamw_kernel(params: Sequence[Tensor], default: str = "foreach") -> Decision:
    """Time one AdamW step of each kernel on tensors shaped like ``params`` (see :func:`probe_tensors`)."""
    like = probe_tensors(params)
    key = {"shapes": [list(t.shape) for t in like], "dtypes": sorted({str(t.dtype) for t in like}),
           "device": str(like[0].device) if like else "cpu"}
    candidates = {k: _adamw_step(like, k) for k in ADAMW_KERNELS}
    return measured_choice("optimizer.adamw_kernel", key, candidates, default)


def choose_ns_dtype(shapes: Sequence[Sequence[int]], orthogonalise: Callable[[Tensor, torch.dtype], Any],
                    device: torch.device | str = "cpu", default: str = "bfloat16", key: dict[str, Any] | None = None
                    ) -> Decision:
    """Time Muon's Newton-Schulz (``orthogonalise(stack, dtype)``, e.g. ``BatchedMuon``'s) on stacks of these
    ``(n, rows, cols)`` shapes in each of :data:`NS_DTYPES`; ``key`` adds what else the timing depends on (steps).

    On a CPU without native bf16 kernels (oneDNN's check: no AVX512-BF16 or AMX) bfloat16 is ruled out untimed: its
    matmuls are emulated there, 57-507x slower (a Zen3: 949.6 ms a call against 15.5 ms in float32), and timing them
    would cost more than the run saves."""
    if torch.device(device).type == "cpu" and not cpu_has_native_bf16():
        return Decision("optimizer.ns_dtype", "float32", "bfloat16 ruled out, not timed: this CPU has no native bf16 "
                                                         "kernels (no AVX512-BF16/AMX)", {"bfloat16": None})
    stacks = [torch.randn(tuple(s), device=device) for s in shapes]

    def run_in(dtype: torch.dtype) -> Callable[[], None]:
        return lambda: [orthogonalise(stack, dtype) for stack in stacks]

    candidates = {name: run_in(getattr(torch, name)) for name in NS_DTYPES}
    full_key = {"shapes": sorted(list(s) for s in shapes), "device": str(device), **(key or {})}
    return measured_choice("optimizer.ns_dtype", full_key, candidates, default)
