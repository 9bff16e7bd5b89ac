"""The GPU table of ``scripts/selfcheck.py --gpu --table``: its cells, verdict lines, and JSON/markdown files.

Pure functions on measured numbers (no CUDA needed): the measuring itself is in ``scripts/selfcheck_table.py``.
Every ratio compares two cells measured in the same process on the same GPU, as
``benchmarks/`` does for CPU numbers.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

PRECISIONS = ("32-true", "tf32", "bf16-mixed", "16-mixed")  # tf32 = 32-true with TF32 matmuls ("high")
MICRO_BATCHES = (1, 2, 4, 8)
ZERO_STAGES = (1, 2, 3)
GIB = 1024 ** 3


@dataclass
class Cell:
    """One measured configuration of the charlm GPT on one GPU.

    Args:
        group: ``"precision"`` (precision x micro-batch grid), ``"checkpointing"`` or ``"zero"``.
        precision: One of :data:`PRECISIONS`.
        micro_batch: Sequences per step.
        zero_stage: ZeRO stage, ``None`` for no ZeRO (plain single-device Lightning).
        offload: ZeRO optimizer (and, at stage 3, parameter) offload to host memory.
        checkpointing: Activation checkpointing of every transformer block.
        tokens_per_sec: Training tokens per second over the timed steps (after warm-up, synchronised).
        peak_allocated_bytes: ``torch.cuda.max_memory_allocated`` over the timed steps.
        status: ``"ok"``, ``"oom"``, ``"error: ..."``, ``"skipped: ..."`` or ``"not run"``.
    """

    group: str
    precision: str
    micro_batch: int
    zero_stage: int | None = None
    offload: bool = False
    checkpointing: bool = False
    tokens_per_sec: float | None = None
    peak_allocated_bytes: int | None = None
    status: str = "not run"

    @property
    def label(self) -> str:
        parts = [self.precision, f"micro-batch {self.micro_batch}"]
        if self.zero_stage is not None:
            parts.append(f"ZeRO-{self.zero_stage}" + (" + offload" if self.offload else ""))
        if self.checkpointing:
            parts.append("activation checkpointing")
        return ", ".join(parts)

    @property
    def ok(self) -> bool:
        return self.status == "ok" and bool(self.tokens_per_sec) and self.peak_allocated_bytes is not None


def plan_cells(precisions: Iterable[str] = PRECISIONS, micro_batches: Iterable[int] = MICRO_BATCHES,
               stages: Iterable[int] = ZERO_STAGES, reference_precision: str = "bf16-mixed",
               reference_micro_batch: int = 8) -> list[Cell]:
    """Every cell of the table, most informative first (a run out of time drops the tail).

    The precision x micro-batch grid comes first; activation checkpointing and ZeRO rows run at the
    reference precision and micro-batch, whose plain grid cell is their baseline.
    """
    cells = [Cell("precision", p, m) for p in precisions for m in micro_batches]
    cells.append(Cell("checkpointing", reference_precision, reference_micro_batch, checkpointing=True))
    cells += [Cell("zero", reference_precision, reference_micro_batch, zero_stage=s, offload=o)
              for s in stages for o in (False, True)]
    return cells


def _find(cells: list[Cell], **match: Any) -> Cell | None:
    defaults = {"zero_stage": None, "offload": False, "checkpointing": False}
    want = {**defaults, **match}
    return next((c for c in cells if all(getattr(c, k) == v for k, v in want.items())), None)


def compare(name: str, cell: Cell | None, base: Cell | None, base_name: str, context: str) -> str:
    """One verdict line: ``cell`` vs ``base`` in tokens/s and peak memory, or why there is no comparison."""
    for who, c in ((name, cell), (base_name, base)):
        if c is None:
            return f"{name}: no comparison ({who} was not planned)"
        if not c.ok:
            return f"{name}: no comparison ({who} {c.status})"
    speed = cell.tokens_per_sec / base.tokens_per_sec
    memory = cell.peak_allocated_bytes / base.peak_allocated_bytes
    return f"{name}: x{speed:.2f} tokens/s, peak memory x{memory:.2f} vs {base_name} ({context})"


def verdicts(cells: list[Cell], reference_precision: str = "bf16-mixed") -> list[str]:
    """One line per technique: each precision vs 32-true, the largest micro-batch vs 1, checkpointing, ZeRO."""
    lines = []
    grid = [c for c in cells if c.group == "precision"]
    batches = sorted({c.micro_batch for c in grid})
    for precision in [p for p in PRECISIONS if p != "32-true" and any(c.precision == p for c in grid)]:
        both = [m for m in batches if (a := _find(grid, precision=precision, micro_batch=m)) and a.ok
                and (b := _find(grid, precision="32-true", micro_batch=m)) and b.ok]
        m = max(both) if both else max(batches)
        lines.append(compare(precision, _find(grid, precision=precision, micro_batch=m),
                             _find(grid, precision="32-true", micro_batch=m), "32-true", f"micro-batch {m}"))
    if len(batches) > 1:
        fitting = [m for m in batches if (c := _find(grid, precision=reference_precision, micro_batch=m)) and c.ok]
        top = max(fitting) if fitting else max(batches)
        lines.append(compare(f"micro-batch {top}", _find(grid, precision=reference_precision, micro_batch=top),
                             _find(grid, precision=reference_precision, micro_batch=batches[0]),
                             f"micro-batch {batches[0]}", reference_precision))
    for cell in cells:
        if cell.group == "precision":
            continue
        base = _find(grid, precision=cell.precision, micro_batch=cell.micro_batch)
        name = "activation checkpointing" if cell.checkpointing else cell.label.split(", ")[-1]
        base_name = "no checkpointing" if cell.checkpointing else "no ZeRO"
        lines.append(compare(name, cell, base, base_name, f"{cell.precision}, micro-batch {cell.micro_batch}"))
    return lines


def _fmt_tokens(cell: Cell) -> str:
    return f"{cell.tokens_per_sec:,.0f}" if cell.tokens_per_sec else "-"


def _fmt_gib(cell: Cell) -> str:
    return f"{cell.peak_allocated_bytes / GIB:.2f}" if cell.peak_allocated_bytes is not None else "-"


def to_markdown(cells: list[Cell], verdict_lines: list[str], checks: list[dict[str, str]],
                meta: dict[str, Any]) -> str:
    """The report as markdown: machine line, the table, the verdict lines, the pass/fail of each GPU check."""
    out = ["# lit_speed GPU selfcheck", "",
           " | ".join(f"{k}: {v}" for k, v in meta.items()), "",
           "| group | configuration | tokens/s | peak allocated (GiB) | status |",
           "|---|---|---:|---:|---|"]
    out += [f"| {c.group} | {c.label} | {_fmt_tokens(c)} | {_fmt_gib(c)} | {c.status} |" for c in cells]
    out += ["", "## Verdicts", ""] + [f"- {line}" for line in verdict_lines]
    out += ["", "## GPU checks", "", "| check | result | detail |", "|---|---|---|"]
    out += [f"| {c['name']} | {c['status']} | {c['detail']} |" for c in checks]
    return "\n".join(out) + "\n"


def write_report(out_dir: str | Path, cells: list[Cell], verdict_lines: list[str], checks: list[dict[str, str]],
                 meta: dict[str, Any]) -> tuple[Path, Path]:
    """Write ``gpu_table.json`` and ``gpu_table.md`` into ``out_dir``; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"meta": meta, "cells": [{**asdict(c), "label": c.label} for c in cells],
               "verdicts": verdict_lines, "checks": checks}
    json_path, md_path = out / "gpu_table.json", out / "gpu_table.md"
    json_path.write_text(json.dumps(payload, indent=1))
    md_path.write_text(to_markdown(cells, verdict_lines, checks, meta))
    return json_path, md_path
