"""Compare two Lightning checkpoints tensor by tensor: ``python compare_checkpoints.py a.ckpt b.ckpt``."""
from __future__ import annotations

import sys
from pathlib import Path
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


def training_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Weights and optimizer state of a Lightning checkpoint file or a DeepSpeed checkpoint folder."""
    path = Path(path)
    if path.is_file():
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        return flat_tensors({"weights": ckpt["state_dict"], "optimizer": ckpt["optimizer_states"]})
    # DeepSpeed: model states load weights-only; the optimizer shards hold the DeepSpeed config (not weights-only)
    out: dict[str, torch.Tensor] = {}
    for part in sorted(path.rglob("*model_states.pt")):
        out.update(flat_tensors(torch.load(part, map_location="cpu", weights_only=True)["module"], f"weights/{part.name}"))
    for part in sorted(path.rglob("*optim_states.pt")):
        state = torch.load(part, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        out.update(flat_tensors(state, f"optimizer/{part.name}"))
    return out


def max_abs_differences(a: str | Path, b: str | Path) -> dict[str, float]:
    """Largest absolute difference per tensor between two checkpoints (0.0 = bitwise equal)."""
    ta, tb = training_tensors(a), training_tensors(b)
    if ta.keys() != tb.keys():
        raise AssertionError(f"different tensors: only in a {sorted(ta.keys() - tb.keys())[:5]}, "
                             f"only in b {sorted(tb.keys() - ta.keys())[:5]}")
    return {k: 0.0 if torch.equal(ta[k], tb[k]) else float((ta[k].double() - tb[k].double()).abs().max())
            for k in ta}


#: metrics.csv columns that measure the machine (time, memory, throughput), not the run: they differ run to run
MACHINE_COLUMNS = ("stats/", "time/", "throughput/", "perf/")


def metrics_rows(path: str | Path) -> list[tuple[tuple[str, str], ...]]:
    """The rows of a ``metrics.csv`` on the columns a deterministic run reproduces, in file order (rows left with
    only ``epoch``/``step`` are dropped): two runs that trained alike have equal lists."""
    import csv

    rows = []
    with Path(path).open(newline="") as f:
        for row in csv.DictReader(f):
            kept = tuple(sorted((k, v) for k, v in row.items() if v and not k.startswith(MACHINE_COLUMNS)))
            if any(k not in ("epoch", "step") for k, _ in kept):
                rows.append(kept)
    return rows


if __name__ == "__main__":
    diffs = max_abs_differences(sys.argv[1], sys.argv[2])
    print(f"{sum(d == 0 for d in diffs.values())}/{len(diffs)} "
          f"tensors bitwise equal; max diff {max(diffs.values()):.3g}")
