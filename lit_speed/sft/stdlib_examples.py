"""Instruction and chat examples built from this Python's standard library (nothing is downloaded).

``data.source=stdlib`` (the ``sft_lora`` preset's default) trains on them; ``python -m lit_speed.sft.stdlib_examples
<folder>`` writes them as JSONL files to look at or to pass elsewhere. Every public module-level function and class
of the standard library's top-level modules whose source has a docstring becomes one example: the question names it
with its signature, the answer is its docstring (most are a few lines, a long tail runs to hundreds of tokens: the
spread of lengths real instruction data has). The source files are parsed (``ast``), never imported.

Formats written: ``chat`` (``messages``: a system turn, the question, the answer, and a second user/assistant turn
asking for the module), ``prompt_completion`` and ``instruction`` (Alpaca's ``instruction``/``input``/``output``).
"""
from __future__ import annotations

import ast
import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import Iterator

FORMATS = ("chat", "prompt_completion", "instruction")
SYSTEM = "You are a concise assistant that explains the Python standard library."


def _documented(path: Path) -> Iterator[tuple[str, str, str]]:
    """``(module, signature, docstring)`` of the public, documented top-level functions and classes of ``path``."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
        return
    module = path.stem
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc.strip()) < 20:
            continue
        args = ast.unparse(node.args) if isinstance(node, ast.FunctionDef) else ""
        kind = "function" if isinstance(node, ast.FunctionDef) else "class"
        yield module, f"{kind} {module}.{node.name}({args})", doc.strip()


def stdlib_examples(limit: int | None = None) -> list[dict[str, str]]:
    """``{module, signature, doc}`` of every documented public function and class, in sorted file order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.glob("*.py")):
        for module, signature, doc in _documented(path):
            out.append({"module": module, "signature": signature, "doc": doc})
            if limit is not None and len(out) >= limit:
                return out
    return out


def as_format(item: dict[str, str], fmt: str) -> dict:
    """One example in ``fmt`` (see the module docstring)."""
    question = f"What does the Python {item['signature']} do?"
    if fmt == "chat":
        return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question},
                             {"role": "assistant", "content": item["doc"]},
                             {"role": "user", "content": "Which module do I import it from?"},
                             {"role": "assistant", "content": f"From the {item['module']} module: import "
                                                              f"{item['module']}."}]}
    if fmt == "prompt_completion":
        return {"prompt": question, "completion": item["doc"]}
    if fmt == "instruction":
        return {"instruction": "Explain what this Python standard-library object does.", "input": item["signature"],
                "output": item["doc"]}
    raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")


def write_jsonl(folder: str | os.PathLike, fmt: str = "chat", limit: int | None = None) -> Path:
    """``<folder>/stdlib_<fmt>.jsonl`` (written once; a second call with the same arguments returns it)."""
    path = Path(folder) / f"stdlib_{fmt}{'' if limit is None else f'_{limit}'}.jsonl"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text("".join(json.dumps(as_format(item, fmt)) + "\n" for item in stdlib_examples(limit)))
    os.replace(tmp, path)
    return path


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else "."
    for name in FORMATS:
        print(write_jsonl(target, name))
