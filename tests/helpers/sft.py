"""Tiny instruction and chat data sets for the SFT tests, built from this Python's standard library (no download)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from lit_speed.sft.stdlib_examples import as_format, stdlib_examples


def short_examples(n: int = 40, doc_chars: int = 160) -> list[dict[str, str]]:
    """The first ``n`` stdlib examples, docstrings cut to ``doc_chars`` (tiny models, short windows)."""
    return [{**item, "doc": item["doc"][:doc_chars]} for item in stdlib_examples(n)]


def write_jsonl(path: Path, records: Iterable[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_examples(folder: Path, fmt: str = "chat", n: int = 40, doc_chars: int = 160) -> Path:
    """``<folder>/<fmt>.jsonl`` of ``n`` short stdlib examples in ``fmt`` (``chat``, ``prompt_completion``,
    ``instruction``)."""
    return write_jsonl(Path(folder) / f"{fmt}.jsonl", (as_format(e, fmt) for e in short_examples(n, doc_chars)))
