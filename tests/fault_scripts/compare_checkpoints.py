"""Compare two Lightning checkpoints tensor by tensor: ``python compare_checkpoints.py a.ckpt b.ckpt``."""
from __future__ import annotations

import sys
from typing import Any

import torch


def flat_tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor inside nested dicts/lists, keyed by its path."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else []
    out: dict[str, torch.Tensor] = {}
    for key, value in items:
        out.update(flat_tensors(value, f"{prefix}/{key}"))
    return out


def max_abs_differences(a: dict, b: dict, keys: tuple[str, ...] = ("state_dict", "optimizer_states")) -> dict[str, float]:
    """Largest absolute difference per tensor of the given top-level keys (0.0 = bitwise equal)."""
    ta = flat_tensors({k: a[k] for k in keys})
    tb = flat_tensors({k: b[k] for k in keys})
    if ta.keys() != tb.keys():
        raise AssertionError(f"different tensors: only in a {sorted(ta.keys() - tb.keys())[:5]}, "
                             f"only in b {sorted(tb.keys() - ta.keys())[:5]}")
    return {k: 0.0 if torch.equal(ta[k], tb[k]) else float((ta[k].double() - tb[k].double()).abs().max())
            for k in ta}


if __name__ == "__main__":
    a, b = (torch.load(p, map_location="cpu", weights_only=True) for p in sys.argv[1:3])
    diffs = max_abs_differences(a, b)
    print(f"steps {a['global_step']} vs {b['global_step']}; {sum(d == 0 for d in diffs.values())}/{len(diffs)} "
          f"tensors bitwise equal; max diff {max(diffs.values()):.3g}")
