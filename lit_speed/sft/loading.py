"""Reading the user's examples with Hugging Face ``datasets``: files (JSONL, JSON, Parquet, CSV) or a dataset id.

``datasets`` is the ecosystem's loader: Arrow tables memory-mapped from its cache, so a data set larger than memory
still loads, and the same files are not parsed twice. :func:`load_records` takes

- one file, a list of files, a glob (``data/*.jsonl``) or a folder (its ``.jsonl``/``.json``/``.parquet``/``.csv``
  files, sorted; one kind per data set), each loaded on its own so that a row can be traced to its file and line;
- or a Hugging Face dataset id (``tatsu-lab/alpaca``): from the Hub when it can be reached, else from the local
  ``datasets`` cache, else a one-line refusal (without network the Hub client would retry for half a minute).

Every failure is one line naming the file (and line) and the setting: a malformed JSON line is found by reading the
file line by line once ``datasets`` has refused it.
"""
from __future__ import annotations

import glob as globbing
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
HUB_HOST = ("huggingface.co", 443)


class DataError(ValueError):
    """A data set that cannot be read or trained on: the message starts with the setting and names the file and
    line (``lit_speed.run.refusals`` shows it as it is)."""

    names_its_setting = True


@dataclass(frozen=True)
class Part:
    """One file of a data set (or the whole of a Hub split) and the rows it holds."""

    name: str       # a path, or "<id>[<split>]"
    kind: str       # ".jsonl", ".json", ".parquet", ".csv" or "hub"
    rows: int


@dataclass
class Records:
    """The loaded rows (a ``datasets.Dataset``), where each came from, and a key of their content
    (:func:`content_key`)."""

    dataset: Any
    parts: list[Part]
    fingerprint: str

    def where(self, row: int) -> str:
        """``"train.jsonl line 17"``, ``"data.csv row 3 (line 4)"``, ``"tatsu-lab/alpaca[train] row 9"``."""
        for part in self.parts:
            if row < part.rows:
                if part.kind == ".jsonl":
                    return f"{part.name} line {_jsonl_line(part.name, row)}"
                if part.kind == ".csv":
                    return f"{part.name} row {row + 1} (line {row + 2})"
                return f"{part.name} record {row + 1}" if part.kind == ".json" else f"{part.name} row {row + 1}"
            row -= part.rows
        return f"row {row}"


def _jsonl_line(path: str, row: int) -> int:
    """The line number of the ``row``-th non-blank line of a JSONL file (blank lines hold no record)."""
    seen = -1
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                seen += 1
                if seen == row:
                    return number
    return row + 1


def resolve_files(source: str | Sequence[str], setting: str = "data.source") -> list[Path]:
    """The files ``source`` names (a file, a list, a glob or a folder), sorted within a glob or folder.

    Raises:
        DataError: Nothing matches, a file type no builder reads, or several types in one data set.
    """
    items = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    files: list[Path] = []
    for item in items:
        path = Path(str(item)).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in BUILDERS
                           and not any(part.startswith(".") for part in p.relative_to(path).parts))
            if not found:
                raise DataError(f"{setting}={item}: the folder holds no {'/'.join(BUILDERS)} file. Fix: "
                                f"{setting}=<a .jsonl file, a folder of them, or a glob such as data/*.jsonl>")
            files += found
        elif any(ch in str(item) for ch in "*?["):
            found = sorted(Path(p) for p in globbing.glob(str(path), recursive=True) if Path(p).is_file())
            if not found:
                raise DataError(f"{setting}={item}: the pattern matches no file. Fix: {setting}=<a file, a folder or "
                                "a glob that matches>")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"{setting}={item}: no such file or folder. Fix: {setting}=<a .jsonl/.json/.parquet/.csv "
                            "file, a list, a glob or a folder>, or a Hugging Face dataset id")
    kinds = {p.suffix for p in files}
    unknown = sorted(kinds - set(BUILDERS))
    if unknown:
        raise DataError(f"{setting}: {files[0] if len(files) == 1 else 'the files'} ({', '.join(unknown)}) is not a "
                        f"type datasets reads here. Fix: {setting}=<{', '.join(BUILDERS)} files>")
    if len({BUILDERS[k] for k in kinds}) > 1:
        raise DataError(f"{setting}: one data set of several file types ({', '.join(sorted(kinds))}). Fix: one type "
                        "per data set (convert the others, e.g. Dataset.to_json)")
    return files


def is_hub_id(source: Any) -> bool:
    """``owner/name`` or ``name`` that is not a path here (no file, no folder, no glob, no file suffix)."""
    if not isinstance(source, str) or not source or Path(source).expanduser().exists():
        return False
    return not any(ch in source for ch in "*?[\\") and Path(source).suffix not in BUILDERS and \
        source.count("/") <= 1 and not source.startswith((".", "/", "~"))


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face Hub answers on its port (``HF_ENDPOINT`` respected), within ``timeout`` seconds."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host = endpoint.split("://", 1)[-1].split("/", 1)[0]
    name, _, port = host.partition(":")
    try:
        socket.create_connection((name, int(port or (443 if endpoint.startswith("https") else 80))), timeout).close()
        return True
    except OSError:
        return False


def _first_bad_json_line(path: Path) -> tuple[int, str] | None:
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as error:
                return number, error.msg
            if not isinstance(value, dict):
                return number, f"a JSON {type(value).__name__}, not an object"
    return None


def _load_file(path: Path, cache_dir: str | None, setting: str) -> Any:
    import datasets

    if path.suffix == ".jsonl":  # a malformed line: found here, cheaply, before datasets' error without a line
        bad = _first_bad_json_line(path)
        if bad is not None:
            raise DataError(f"{setting}: {path} line {bad[0]} is not a JSON object ({bad[1]}). Fix: correct or "
                            "remove that line")
    try:
        return datasets.load_dataset(BUILDERS[path.suffix], data_files=str(path), split="train", cache_dir=cache_dir)
    except Exception as error:  # noqa: BLE001 - Arrow, JSON and CSV parsers raise many types
        raise DataError(f"{setting}: datasets could not read {path} ({type(error).__name__}: "
                        f"{' '.join(str(error).split())[:200]}). Fix: a valid {path.suffix} file") from None


def _load_hub(source: str, split: str, cache_dir: str | None, setting: str) -> Any:
    import datasets

    from lit_speed.compat.datasets import hub_offline

    online = hub_reachable()
    try:
        with hub_offline(not online):  # offline: its local cache only, no half-minute of retries
            return datasets.load_dataset(source, split=split, cache_dir=cache_dir)
    except Exception as error:  # noqa: BLE001 - hub, cache and builder errors vary
        why = "" if online else "the Hugging Face Hub cannot be reached (no network) and the dataset is not in " \
                                "the local datasets cache; "
        raise DataError(f"{setting}={source}: not a file or folder here; {why}load_dataset failed "
                        f"({type(error).__name__}: {' '.join(str(error).split())[:160]}). Fix: {setting}=<a local "
                        ".jsonl/.json/.parquet/.csv file or folder> (save the dataset with Dataset.to_json where there "
                        "is network), or run with network") from None


def load_records(source: str | Sequence[str], split: str = "train", cache_dir: str | None = None,
                 setting: str = "data.source") -> Records:
    """The rows of ``source`` as one ``datasets.Dataset`` (see the module docstring).

    Raises:
        DataError: A missing or unreadable file, a malformed JSON line (file and line named), a dataset id that
            can be neither fetched nor found in the cache, or no rows at all.
    """
    try:
        import datasets
    except ImportError:
        raise DataError(f"{setting}: reading instruction data needs the datasets package. Fix: pip install -e "
                        "\".[finetune]\" (or bash scripts/run.sh setup)") from None
    datasets.disable_progress_bars()
    if is_hub_id(source):
        dataset = _load_hub(str(source), split, cache_dir, setting)
        parts = [Part(f"{source}[{split}]", "hub", len(dataset))]
        tables = [dataset]
    else:
        files = resolve_files(source, setting)
        tables = [_load_file(path, cache_dir, setting) for path in files]
        parts = [Part(str(path), path.suffix, len(table)) for path, table in zip(files, tables)]
        held = [sorted(t.column_names) for t in tables]
        try:  # datasets fills a column one file lacks with nulls: refused here, before a record turns up empty
            if any(h != held[0] for h in held):
                raise ValueError("other column names")
            dataset = tables[0] if len(tables) == 1 else datasets.concatenate_datasets(tables)
        except ValueError as error:  # other columns, or other types of one column, in another file
            raise DataError(f"{setting}: the files do not hold the same columns ({' '.join(str(error).split())[:160]}"
                            f"; {', '.join(f'{p.name}: {t.column_names}' for p, t in zip(files, tables))[:200]}). "
                            "Fix: one format per data set") from None
    if len(dataset) == 0:
        raise DataError(f"{setting}={source}: no rows. Fix: {setting}=<files that hold examples>")
    return Records(dataset, parts, content_key(tables))


def content_key(tables: Sequence[Any]) -> str:
    """What identifies the rows' content for the tokenized cache: every Arrow file behind them, its size and
    modification time (a rewritten source file is parsed again by ``datasets``, into a new Arrow file)."""
    stamps = []
    for table in tables:
        for entry in getattr(table, "cache_files", None) or []:
            try:
                stat = os.stat(entry["filename"])
            except OSError:
                continue
            stamps.append(f"{entry['filename']}|{stat.st_size}|{stat.st_mtime_ns}")
    return "|".join(stamps) or repr([len(t) for t in tables])
