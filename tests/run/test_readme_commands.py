"""Every ``python scripts/train.py ...`` command the README shows composes and passes the pre-flight checks.

The README is the user's first contact: a command there that no longer composes (a renamed option, a moved
key) is a broken promise. Each command is run through :func:`lit_speed.run.config_check.preflight`, the same
composition and checks ``scripts/train.py`` does before anything is built (no training). The commands the
README shows failing (``$ python scripts/train.py precision=fp8`` followed by its ``Config error: ...``) must
fail with the message printed under them.
"""
from __future__ import annotations

import re
import shlex

import pytest

from lit_speed.run.config_check import preflight
from lit_speed.run.config_error import ConfigError
from tests.helpers.repo import ROOT, docs_text

README = docs_text()  # the top README and the component cards
ENTRY = "scripts/train.py"


def _code_lines(text: str) -> list[str]:
    """Lines inside fenced code blocks, with backslash continuations joined."""
    lines, joined, inside = [], "", False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
            continue
        if not inside:
            continue
        joined += line.rstrip()[:-1] + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            lines.append(joined)
            joined = ""
    return lines


# argv -> the PYTHONPATH its command sets (``PYTHONPATH=examples/own_model python scripts/train.py ...``)
PYTHONPATHS: dict[tuple[str, ...], str] = {}


def _argv(command: str) -> list[str] | None:
    """The arguments after ``scripts/train.py``, or ``None`` for a placeholder command (``...``, ``<run>``)."""
    command = re.split(r"\s#\s|\s{2,}#", command)[0]  # drop a trailing comment
    words = shlex.split(command)
    argv = words[words.index(ENTRY) + 1:] if ENTRY in words else []
    if any("..." in w or "<" in w for w in argv):
        return None
    path = next((w.split("=", 1)[1] for w in words[:words.index("python")] if w.startswith("PYTHONPATH=")), None) \
        if "python" in words else None
    if path is not None:
        PYTHONPATHS[tuple(argv)] = path
    return argv


def readme_commands() -> tuple[list[list[str]], list[tuple[list[str], str]]]:
    """(commands that must pass, (commands that must fail, the error the README prints for each))."""
    passing, failing = [], []
    lines = _code_lines(README)
    for i, line in enumerate(lines):
        text = line.strip()
        if f"python {ENTRY}" not in text or text.startswith("#"):
            continue
        argv = _argv(text)
        if argv is None:
            continue
        if text.startswith("$ "):
            shown = lines[i + 1].strip()
            failing.append((argv, shown.removeprefix("Config error: ").split("...")[0].strip()))
        else:
            passing.append(argv)
    for inline in re.findall(rf"`python {re.escape(ENTRY)}([^`]*)`", README):
        argv = _argv(f"python {ENTRY}{inline}")
        if argv is not None:
            passing.append(argv)
    unique = list({tuple(a): a for a in passing}.values())  # the bare default run appears three times
    return unique, failing


PASSING, FAILING = readme_commands()


def test_the_readme_shows_the_commands_this_test_expects_to_find() -> None:
    # guards the extraction itself: the headline commands of the README's first screen are found
    assert ["precision=bf16-mixed", "strategy=zero2", "accumulation=ramp"] in PASSING
    assert ["-m", "precision=32-true,bf16-mixed", "strategy=auto,zero2"] in PASSING
    assert len(PASSING) >= 20 and len(FAILING) >= 2


@pytest.mark.parametrize("argv", PASSING, ids=[" ".join(a)[:80] or "(defaults)" for a in PASSING])
def test_readme_command_composes_and_passes_preflight(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    if tuple(argv) in PYTHONPATHS:  # the command's own PYTHONPATH= (a user's package), relative to the checkout
        monkeypatch.syspath_prepend(str(ROOT / PYTHONPATHS[tuple(argv)]))
    monkeypatch.chdir(ROOT)  # relative --config-dir / file:// paths are relative to where the command runs
    preflight(argv)


@pytest.mark.parametrize(("argv", "shown"), FAILING, ids=[" ".join(a) for a, _ in FAILING])
def test_readme_error_example_fails_with_the_message_it_shows(argv: list[str], shown: str) -> None:
    with pytest.raises(ConfigError) as error:
        preflight(argv)
    assert str(error.value).startswith(shown), f"README shows {shown!r}; the run says {str(error.value)!r}"
