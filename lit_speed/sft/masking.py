"""Which tokens a conversation trains on, from the rendered template's character spans and the tokenizer's offsets.

:func:`render_spans` renders the conversation once in full and, for each assistant turn, the conversation before it
with the generation prompt and the conversation up to its end: the turn's trained characters are the difference
(its content and what the template writes after it, e.g. ``<|im_end|>\\n``: the model learns to stop).
:func:`tokenize_spans` tokenizes the full text once with the offsets of each token and trains every token whose
characters overlap a span. Tokens are never tokenized piece by piece, so a template (or a tokenizer) that merges
characters across the prompt/response boundary gets the token it really produces, trained as TRL trains it (the
first token that differs from the prompt's own tokens is the first trained token).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from lit_speed.sft.formats import RecordError

TRAIN_ON = ("responses", "last_response", "all")


def render(tokenizer: Any, turns: Sequence[dict[str, str]], template: str, generation_prompt: bool) -> str:
    """``turns`` rendered with ``template`` (and the generation prompt when asked).

    Raises:
        RecordError: The template fails to render them.
    """
    try:
        return tokenizer.apply_chat_template(list(turns), chat_template=template, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except Exception as error:  # noqa: BLE001 - Jinja's errors (TemplateError, UndefinedError, TypeError) vary
        raise RecordError(f"the chat template failed to render it ({type(error).__name__}: "
                          f"{' '.join(str(error).split())[:160]})",
                          fix="data.template=<one that renders these roles, e.g. alpaca>") from None


def render_spans(tokenizer: Any, turns: Sequence[dict[str, str]] | str, template: str | None,
                 train_on: str = "responses", eos_token: str | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the ``[start, end)`` character spans it trains on.

    Args:
        turns: A conversation, or a plain text (trained on every token; ``eos_token`` appended unless it ends with it).
        template: Jinja chat template (unused for plain text).
        train_on: ``responses`` (every assistant turn), ``last_response`` or ``all``.

    Raises:
        RecordError: The template fails to render, or renders a turn differently once later turns follow (then the
            spans cannot be found; ``train_on=last_response`` needs only the last).
    """
    if isinstance(turns, str):
        text = turns if not eos_token or turns.endswith(eos_token) else turns + eos_token
        return text, [(0, len(text))]
    full = render(tokenizer, turns, template, False)
    if train_on == "all":
        return full, [(0, len(full))]
    spans = []
    last = max(i for i, t in enumerate(turns) if t["role"] == "assistant")
    for i, turn in enumerate(turns):
        if turn["role"] != "assistant" or (train_on == "last_response" and i != last):
            continue
        before = render(tokenizer, turns[:i], template, True)
        upto = render(tokenizer, turns[: i + 1], template, False) if i < len(turns) - 1 else full
        if not (upto.startswith(before) and full.startswith(upto)):
            raise RecordError(f"the chat template renders turn {i} differently once later turns follow (or the "
                              "prompt differently with the generation prompt), so the response's tokens cannot be "
                              "found in the rendered text",
                              fix="data.train_on=last_response, or data.template=<a template that renders every "
                                  "turn as it renders the last>")
        if len(upto) > len(before):
            spans.append((len(before), len(upto)))
    return full, spans


def trained_mask(offsets: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """``bool`` per token: its characters ``offsets[i] = (start, end)`` overlap a span (a zero-width token counts at
    its start)."""
    starts, ends = offsets[:, 0], offsets[:, 1]
    mask = np.zeros(len(offsets), dtype=bool)
    for a, b in spans:
        mask |= (starts < b) & np.where(ends > starts, ends > a, starts >= a)
    return mask


def tokenize_spans(tokenizer: Any, texts: Sequence[str], spans: Sequence[Sequence[tuple[int, int]]]
                   ) -> tuple[list[list[int]], list[np.ndarray]]:
    """Token ids of each text (no special tokens added: the template writes its own) and its trained mask."""
    encoded = tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True)
    masks = [trained_mask(np.asarray(off, dtype=np.int64).reshape(-1, 2), s)
             for off, s in zip(encoded["offset_mapping"], spans)]
    return encoded["input_ids"], masks
