"""A tiny chat model and tiny instruction data sets, built once per test session (nothing is downloaded)."""
from __future__ import annotations

import pytest

from tests.helpers.sft import write_examples
from tests.helpers.tiny_hf import save_tiny_causal_lm


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory):
    """A 2-layer Llama whose tokenizer has ChatML's tokens and template (an instruct model's folder)."""
    return save_tiny_causal_lm(tmp_path_factory.mktemp("chat_model"), chat=True, max_positions=512)


@pytest.fixture(scope="session")
def plain_model(tmp_path_factory):
    """The same model without a chat template (a base model's folder)."""
    return save_tiny_causal_lm(tmp_path_factory.mktemp("plain_model"), max_positions=512)


@pytest.fixture(scope="session")
def examples(tmp_path_factory):
    """``{format: path}`` of 40 short stdlib examples in each format (chat: two assistant turns each)."""
    folder = tmp_path_factory.mktemp("examples")
    return {fmt: write_examples(folder, fmt) for fmt in ("chat", "prompt_completion", "instruction")}
