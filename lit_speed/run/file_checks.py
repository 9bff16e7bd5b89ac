"""Checks of the files a run will read, from the config and a glance at the files, before anything reads them: a text
budget that the first file uses up (:func:`check_text_budget`), a weight file that was not written to its end
(:func:`check_weight_files`). Each refusal names the setting that fits the case, not the one the loader trips on.
``scripts/train.py`` and ``scripts/plan.py`` run them in the pre-flight (``config_rules.check_config``)."""
from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from lit_speed.run.config_error import ConfigError
from lit_speed.strategies.config_facts import ConfigFacts, config_facts


def _int_setting(node: DictConfig, key: str) -> int | None:
    value = node.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def first_readable_texts(files: list[Path], count: int = 2) -> list[tuple[Path, int]]:
    """``(path, characters)`` of the first ``count`` readable, non-empty UTF-8 ``files``, in the order given (the
    order ``lit_speed.data`` reads them in)."""
    found: list[tuple[Path, int]] = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            found.append((path, len(text)))
            if len(found) == count:
                break
    return found


def check_text_budget(cfg: DictConfig, facts: ConfigFacts | None = None) -> None:
    """Refuse a ``data.max_bytes`` that the first text file uses up: the corpus would then hold one file and none is
    left for validation, which the DataModule reports as a ``data.root`` without files (a folder of 30 blamed).

    Raises:
        ConfigError: Naming ``data.max_bytes``, the first file and a budget that reads two.
    """
    if not (facts or config_facts(cfg)).text_folder:
        return
    data = cfg.data
    max_bytes, root = _int_setting(data, "max_bytes"), data.get("root")
    if max_bytes is None or not isinstance(root, str) or root == "???":
        return
    from lit_speed.data.text_folder import DEFAULT_PATTERNS, list_text_files, source_root

    patterns = list(data.get("patterns") or DEFAULT_PATTERNS)
    try:
        folder = source_root(root)
        first_two = first_readable_texts(list_text_files(folder, patterns))
    except (OSError, ValueError):  # no such folder: the DataModule's own message names data.root
        return
    if len(first_two) < 2 or first_two[0][1] < max_bytes:
        return  # too few files (data.root's message), or a budget that reaches the second file
    (first, chars), (_, second) = first_two
    raise ConfigError(f"data.max_bytes={max_bytes}: the first text file ({first.relative_to(folder)}, {chars:,} "
                      f"characters) uses all of it, so one file is read and none is left for validation (2 are "
                      f"needed). Fix: data.max_bytes={chars + second} (the first two files) or more, e.g. 4000000")


def safetensors_problem(path: Path) -> str | None:
    """What makes a ``.safetensors`` file unreadable, from its header and size alone (``None``: complete). The format:
    8 bytes of header length, the JSON header, then the tensors, which must end exactly at the end of the file."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        head = file.read(8)
        if len(head) < 8:
            return f"{size} bytes, not even the 8-byte header length"
        length = int.from_bytes(head, "little")
        if 8 + length > size:
            return f"its header says {length:,} bytes of metadata, the file has {size:,} bytes in all"
        try:
            header = json.loads(file.read(length))
        except ValueError:
            return "its header is not valid JSON"
    if not isinstance(header, dict):
        return "its header is not a table of tensors"
    end = max((int(v["data_offsets"][1]) for k, v in header.items()
               if k != "__metadata__" and isinstance(v, dict) and len(v.get("data_offsets") or ()) == 2), default=0)
    expected = 8 + length + end
    if expected != size:
        return (f"its tensors end at byte {expected:,}, the file has {size:,} bytes" if expected > size else
                f"{size - expected:,} bytes follow its last tensor")
    return None


def check_weight_files(cfg: DictConfig) -> None:
    """Refuse a Hugging Face model folder with a ``.safetensors`` file that was not written to its end (a download or
    ``save_pretrained`` that stopped part-way), before the weights load: the loader's own error names neither the
    file nor the setting (``SafetensorError: ... incomplete metadata, file not fully covered``).

    Raises:
        ConfigError: Naming ``model.pretrained``, the file, what is wrong and the fix.
    """
    from lit_speed.run.memory_fit.fit_check import hf_folder

    folder = hf_folder(cfg)
    if folder is None:
        return
    for path in sorted(folder.glob("*.safetensors")):
        try:
            problem = safetensors_problem(path)
        except OSError as error:
            problem = f"unreadable: {error.strerror or error}"
        if problem is not None:
            raise ConfigError(f"model.pretrained={cfg.model.pretrained}: {path.name} is damaged or was not written to "
                              f"its end ({problem}), as a download or a save_pretrained that stopped part-way leaves "
                              "it. Fix: write or download the folder again, or model.pretrained=<a complete "
                              "save_pretrained folder>")
