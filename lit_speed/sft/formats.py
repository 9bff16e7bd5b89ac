"""The shapes instruction and chat data come in, detected from the columns and turned into one form: messages.

Every record becomes a list of ``{"role", "content"}`` turns (a conversation) or, for a plain text column, one string
trained on every token. Formats, in the order they are looked for (the first whose columns are all present wins):

========================  ==========================================  =========================================
format                    columns                                     becomes
========================  ==========================================  =========================================
``messages``              ``messages`` (or ShareGPT's                 the turns as they are; ShareGPT's
                          ``conversations`` with ``from``/``value``)  human/gpt/system renamed user/assistant/system
``prompt_completion``     ``prompt`` + ``completion`` (strings, or    user: prompt, assistant: completion (turn
                          lists of turns as TRL's conversational      lists are joined as they are)
                          prompt-completion)
``prompt_response``       ``prompt`` + ``response``                   user: prompt, assistant: response
``instruction``           ``instruction`` + ``output`` (+ ``input``)  user: instruction, a blank line, input;
                          (Alpaca)                                    assistant: output
``text``                  ``text``                                    every token trained (no template)
========================  ==========================================  =========================================

``columns={"prompt": "question", "completion": "answer"}`` maps other names onto these; a ``system`` column, where
present, becomes the first turn of every conversation. Plain functions over dict records, no Lightning, no
``datasets`` (TRL's ``is_conversational`` / ``maybe_convert_to_chatml`` do the same job inside TRL).
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Sequence

#: format -> the columns it needs (all) and may use
FORMATS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "messages": (("messages",), ("system",)),
    "prompt_completion": (("prompt", "completion"), ("system",)),
    "prompt_response": (("prompt", "response"), ("system",)),
    "instruction": (("instruction", "output"), ("input", "system")),
    "text": (("text",), ()),
}
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}


class RecordError(ValueError):
    """A record that cannot be trained on: what is wrong with it, and (set by the loader) where it is."""

    def __init__(self, problem: str, row: int | None = None, fix: str = "") -> None:
        super().__init__(problem)
        self.problem, self.row, self.fix = problem, row, fix


class Detected(NamedTuple):
    """The format chosen for a data set and why (a line for the start-up table)."""

    format: str
    columns: dict[str, str]  # the format's column name -> the data's column name
    how: str                 # "detected" or "data.format=..."


def detect_format(found: Sequence[str], format: str = "auto", columns: Mapping[str, str] | None = None,
                  owner: str = "SFTDataModule") -> Detected:
    """The format of a data set whose columns are ``found`` (``format="auto"``), or check the one named;
    ``columns`` maps a format's column names onto the data's.

    Raises:
        ValueError: No format's columns are present, or the named format's are not; naming the columns found and
            the ``columns=`` mapping option.
    """
    mapping = dict(columns or {})
    found = list(found)
    missing_mapped = {ours: theirs for ours, theirs in mapping.items() if theirs not in found}
    if missing_mapped:
        raise ValueError(f"{owner}(columns={mapping}): the data has no column {sorted(missing_mapped.values())} "
                         f"(its columns: {found}). Fix: data.columns={{<format column>: <one of {found}>}}")
    unknown = sorted(set(mapping) - {c for need, may in FORMATS.values() for c in need + may} - {"conversations"})
    if unknown:
        raise ValueError(f"{owner}(columns={mapping}): {unknown} is not a column any format reads (they read "
                         f"{sorted({c for need, may in FORMATS.values() for c in need + may})}). Fix: "
                         "data.columns={prompt: <your prompt column>, completion: <your response column>}")
    renamed = {ours: theirs for ours, theirs in mapping.items()}
    present = set(found) | set(renamed)

    def name(col: str) -> str:
        return renamed.get(col, col)

    if "conversations" in present and "messages" not in present:
        renamed["messages"] = name("conversations")
        present.add("messages")
    if format != "auto":
        if format not in FORMATS:
            raise ValueError(f"{owner}(format={format!r}): must be one of auto, {', '.join(FORMATS)}. Fix: "
                             "data.format=auto (detected from the columns)")
        need = FORMATS[format][0]
        absent = [c for c in need if c not in present]
        if absent:
            raise ValueError(f"{owner}(format={format}): the data has no column {absent} (its columns: {found}). "
                             f"Fix: data.columns={{{absent[0]}: <one of {found}>}}, or data.format=auto")
        chosen, how = format, f"data.format={format}"
    else:
        chosen = next((f for f, (need, _) in FORMATS.items() if all(c in present for c in need)), None)
        if chosen is None:
            expected = "; ".join(f"{f}: {' + '.join(need)}" for f, (need, _) in FORMATS.items())
            raise ValueError(f"{owner}: no known format in the columns {found} (looked for {expected}). Fix: "
                             f"data.columns={{prompt: <your prompt column>, completion: <your response column>}} "
                             "(a mapping onto those names), or data.format=<one of them>")
        how = "detected"
    need, may = FORMATS[chosen]
    return Detected(chosen, {c: name(c) for c in need + may if c in present}, how)


def _content(value: Any, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RecordError(f"{what} is a {type(value).__name__}, not text")
    return value


def _turns(value: Any, what: str) -> list[dict[str, str]]:
    """A list of ``{role, content}`` (ShareGPT's ``{from, value}`` renamed), checked."""
    if not isinstance(value, (list, tuple)):
        raise RecordError(f"{what} is a {type(value).__name__}, not a list of turns")
    turns = []
    for i, turn in enumerate(value):
        if not isinstance(turn, Mapping):
            raise RecordError(f"{what}[{i}] is a {type(turn).__name__}, not a {{role, content}} turn")
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if "role" not in turn and "from" in turn:
            role = SHAREGPT_ROLES.get(str(role).lower(), role)
        if role not in ROLES:
            raise RecordError(f"{what}[{i}] has the role {role!r}, not one of {list(ROLES)}",
                              fix="data.format=... with roles system/user/assistant (ShareGPT's human/gpt are "
                                  "renamed)")
        turns.append({"role": role, "content": _content(content, f"{what}[{i}].content")})
    return turns


def to_conversation(record: Mapping[str, Any], detected: Detected) -> list[dict[str, str]] | str:
    """The record as turns (``[{role, content}, ...]``), or as a string for the ``text`` format.

    Raises:
        RecordError: A field of the wrong type, an unknown role, an empty response, a conversation without an
            assistant turn.
    """
    col = detected.columns
    fmt = detected.format
    if fmt == "text":
        text = _content(record.get(col["text"]), col["text"])
        if not text.strip():
            raise RecordError(f"the {col['text']!r} text is empty")
        return text
    system = _content(record.get(col["system"]), col["system"]) if "system" in col else ""
    if fmt == "messages":
        turns = _turns(record.get(col["messages"]), col["messages"])
    elif fmt in ("prompt_completion", "prompt_response"):
        answer_col = col["completion" if fmt == "prompt_completion" else "response"]
        prompt, answer = record.get(col["prompt"]), record.get(answer_col)
        if isinstance(prompt, (list, tuple)) or isinstance(answer, (list, tuple)):  # TRL's conversational form
            turns = _turns(prompt, col["prompt"]) + _turns(answer, answer_col)
        else:
            turns = [{"role": "user", "content": _content(prompt, col["prompt"])},
                     {"role": "assistant", "content": _content(answer, answer_col)}]
    else:  # instruction / input / output
        instruction = _content(record.get(col["instruction"]), col["instruction"])
        extra = _content(record.get(col["input"]), col["input"]) if "input" in col else ""
        turns = [{"role": "user", "content": f"{instruction}\n\n{extra}" if extra.strip() else instruction},
                 {"role": "assistant", "content": _content(record.get(col["output"]), col["output"])}]
    if system.strip() and not (turns and turns[0]["role"] == "system"):
        turns.insert(0, {"role": "system", "content": system})
    check_conversation(turns)
    return turns


def check_conversation(turns: Sequence[Mapping[str, str]]) -> None:
    """Refuse a conversation that trains nothing or cannot be a chat: no assistant turn, an empty assistant turn,
    a system turn after the first.

    Raises:
        RecordError: Naming the turn.
    """
    if not any(t["role"] == "assistant" for t in turns):
        raise RecordError(f"the conversation has no assistant turn (roles {[t['role'] for t in turns]}): nothing to "
                          "train on")
    for i, turn in enumerate(turns):
        if turn["role"] == "assistant" and not turn["content"].strip():
            raise RecordError(f"turn {i} (assistant) is an empty response")
        if turn["role"] == "system" and i > 0:
            raise RecordError(f"turn {i} is a system turn after the first")


def describe_formats(detected: Detected) -> str:
    """``"messages (detected; columns messages)"``: the start-up table's words for the format."""
    cols = ", ".join(f"{c}" if c == d else f"{c}<-{d}" for c, d in detected.columns.items())
    return f"{detected.format} ({detected.how}; columns {cols})"
