"""Per-rank model-state memory under ZeRO, measured from the real tensors, and its display.

The estimate is :func:`lit_speed.memory.model_state.model_state_bytes` (the one calculator, DeepSpeed's formulas);
this module measures what a rank really holds, to compare with it in ``summary.json``.
"""
from __future__ import annotations

from typing import Any

import torch

from lit_speed.compat import lightning as pl_compat


def format_bytes(n: int) -> str:
    """``1536 -> '1.5 KiB'``: binary units, one decimal."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _state_tensors(optimizer: Any) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    for state in getattr(optimizer, "state", {}).values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return tensors


def measured_optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the optimizer-state tensors (e.g. Adam's ``exp_avg``/``exp_avg_sq``) this rank really holds.

    Unwraps DeepSpeed's ZeRO optimizer (``.optimizer``) down to the torch optimizer and sums its ``state``
    tensors; under ZeRO 1/2/3 those are allocated for this rank's flat partition only. Scalar ``step``
    counters are not counted.

    Args:
        optimizer: A torch optimizer, a DeepSpeed ZeRO optimizer, or a Lightning optimizer wrapper.
    """
    seen: set[int] = set()
    inner = optimizer
    while inner is not None and id(inner) not in seen:
        seen.add(id(inner))
        tensors = _state_tensors(inner)
        if tensors:
            return sum(t.numel() * t.element_size() for t in tensors)
        inner = pl_compat.wrapped_optimizer(inner)
    return 0
