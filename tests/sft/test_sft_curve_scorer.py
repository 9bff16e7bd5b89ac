"""``benchmarks/bench_sft_curve.py``'s scorer: the held-out loss counts the positions lit_speed trains, no others."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lit_speed.sft.masking import render_spans, tokenize_spans
from tests.helpers.tiny_hf import CHATML

ROOT = Path(__file__).resolve().parents[2]
TURN = "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
#: CHATML with TRL's {% generation %} markers around each response and its end marker (what bench_sft marks)
MARKED = CHATML.replace(TURN, "{%- if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{%- generation %}"
                              "{{ message['content'] + '<|im_end|>' + '\n' }}{%- endgeneration %}{%- else %}" + TURN +
                        "{%- endif %}")
TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
         {"role": "assistant", "content": "It is 4."}, {"role": "user", "content": "And 3+3?"},
         {"role": "assistant", "content": "It is 6, and 4+4 is 8."}]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_sft_curve", ROOT / "benchmarks" / "bench_sft_curve.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_sft_curve"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("cut", [False, True])
def test_heldout_loss_scores_exactly_the_response_positions_lit_speed_trains(chat_model, cut):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert MARKED != CHATML
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    text, spans = render_spans(tokenizer, TURNS, CHATML, "responses")
    (ids,), (mask,) = tokenize_spans(tokenizer, [text], [spans])
    max_length = max(i for i, m in enumerate(mask) if m) - 3 if cut else 512  # cut inside the last response, or not
    ids, trained = torch.tensor(ids[:max_length]), torch.tensor(mask[:max_length], dtype=torch.bool)[1:]
    assert 0 < int(trained.sum()) < len(ids) - 1  # prompts and the system turn are not scored
    model = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.bfloat16).float().eval()
    with torch.no_grad():
        logits = model(ids[None]).logits[0, :-1]
    expected = F.cross_entropy(logits[trained], ids[1:][trained]).item()

    scored = load_bench().heldout_loss(chat_model, chat_model, [TURNS], MARKED, max_length, bf16=False)
    assert scored["tokens"] == int(trained.sum())
    assert scored["loss"] == pytest.approx(expected, rel=1e-5)
