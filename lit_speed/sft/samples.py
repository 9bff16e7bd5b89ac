"""Held-out prompts for the generations written at each validation: the prompt's tokens and the reference response."""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from lit_speed.sft.masking import render
from lit_speed.sft.templates import Template


class SamplePrompt(NamedTuple):
    """A validation conversation up to its last response: what to show, the ids to generate from, the reference."""

    prompt: str          # the last user turn (what a reader recognises)
    ids: list[int]       # the rendered conversation before the last response, with the generation prompt
    reference: str       # the data's last response


def sample_prompts(tokenizer: Any, template: Template, conversations: Sequence[Sequence[dict[str, str]]],
                   max_length: int) -> list[SamplePrompt]:
    """One :class:`SamplePrompt` per conversation: its last response whose prompt leaves room to answer within
    ``max_length`` (none when even the first does not)."""
    prompts = []
    for turns in conversations:
        for last in reversed([i for i, t in enumerate(turns) if t["role"] == "assistant"]):
            ids = tokenizer(render(tokenizer, turns[:last], template.text, True), add_special_tokens=False)["input_ids"]
            if len(ids) < max_length:
                user = next((t["content"] for t in reversed(turns[:last]) if t["role"] == "user"), "")
                prompts.append(SamplePrompt(user, ids, turns[last]["content"]))
                break
    return prompts
