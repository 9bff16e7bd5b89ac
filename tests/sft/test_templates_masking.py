"""Templates (lit_speed.sft.templates) and which tokens a conversation trains on (lit_speed.sft.masking)."""
from __future__ import annotations

import numpy as np
import pytest

from lit_speed.sft.formats import RecordError
from lit_speed.sft.masking import render_spans, tokenize_spans, trained_mask
from lit_speed.sft.templates import NAMED, resolve_template, turn_end_ids
from tests.helpers.tiny_hf import CHAT_TOKENS, CHATML, tiny_tokenizer

TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
         {"role": "assistant", "content": "It is 4."}, {"role": "user", "content": "And 3+3?"},
         {"role": "assistant", "content": "It is 6."}]


@pytest.fixture(scope="module")
def chat_tokenizer():
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": CHAT_TOKENS})
    tok.chat_template = CHATML
    return tok


def trained_text(tok, turns, template, train_on="responses"):
    text, spans = render_spans(tok, turns, template, train_on)
    (ids,), (mask,) = tokenize_spans(tok, [text], [spans])
    return tok.decode([i for i, m in zip(ids, mask) if m]), tok.decode([i for i, m in zip(ids, mask) if not m])


def test_every_response_and_its_end_marker_train_and_nothing_else(chat_tokenizer):
    template = resolve_template(chat_tokenizer, "auto")
    assert template.source == "the tokenizer's own" and template.text == CHATML
    trained, masked = trained_text(chat_tokenizer, TURNS, template.text)
    assert trained == "It is 4.<|im_end|>\nIt is 6.<|im_end|>\n"
    assert "Be brief." in masked and "What is 2+2?" in masked and "It is" not in masked
    trained, _ = trained_text(chat_tokenizer, TURNS, template.text, "last_response")
    assert trained == "It is 6.<|im_end|>\n"
    trained, masked = trained_text(chat_tokenizer, TURNS, template.text, "all")
    assert masked == "" and trained.startswith("<|im_start|>system")


def test_a_token_merged_across_the_prompt_response_boundary_trains_as_trl_counts_it():
    tok = tiny_tokenizer()
    # "ing" is one token of this vocabulary (trained on Python source): the prompt ends inside it
    prompt, response = "counti", "ng done"
    assert len(tok("ing", add_special_tokens=False)["input_ids"]) == 1
    turns = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    text, spans = render_spans(tok, turns, NAMED["none"])
    (ids,), (mask,) = tokenize_spans(tok, [text], [spans])
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    common = next(i for i, (a, b) in enumerate(zip(prompt_ids, ids)) if a != b)  # TRL's common_prefix_length
    assert prompt_ids != ids[:len(prompt_ids)], "the test needs a merge at the boundary"
    assert int(np.argmax(mask)) == common and mask[common:].all() and not mask[:common].any()
    assert tok.decode([ids[common]]) == "ing"


def test_the_mask_of_offsets_counts_overlap_and_zero_width_tokens():
    offsets = np.array([[0, 3], [3, 5], [5, 5], [5, 9], [9, 12]])
    assert trained_mask(offsets, [(4, 9)]).tolist() == [False, True, True, True, False]
    assert trained_mask(offsets, [(0, 3), (9, 12)]).tolist() == [True, False, False, False, True]


def test_a_template_that_renders_earlier_turns_otherwise_is_refused_with_the_fix(chat_tokenizer):
    hides = ("{%- for m in messages %}{%- if m['role'] == 'assistant' and not loop.last %}[..]{%- else %}"
             "{{ m['role'] }}: {{ m['content'] }}\n{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
             "assistant: {%- endif %}")
    with pytest.raises(RecordError, match=r"renders turn 2 differently once later turns follow") as error:
        render_spans(chat_tokenizer, TURNS, hides)
    assert "data.train_on=last_response" in error.value.fix
    text, spans = render_spans(chat_tokenizer, TURNS, hides, "last_response")
    assert len(spans) == 1 and text[spans[0][0]:spans[0][1]] == " It is 6."


def test_a_template_that_fails_to_render_names_its_error():
    with pytest.raises(RecordError, match=r"the chat template failed to render it \(TemplateSyntaxError"):
        render_spans(tiny_tokenizer(), TURNS, "{% for m in messages %}{{ m.content }")


def test_a_tokenizer_without_a_template_is_refused_and_named_ones_fit_their_vocabulary(chat_tokenizer, tmp_path):
    plain = tiny_tokenizer()
    with pytest.raises(ValueError, match=r"SFTDataModule\(template=auto\): the tokenizer .* has no chat template\. "
                                         r"Fix: data\.template=<one of chatml, llama3, alpaca, none>"):
        resolve_template(plain, "auto")
    with pytest.raises(ValueError, match=r"template=chatml\): the tokenizer has no <\|im_start\|> token \(the marker "
                                         r"would be \d+ pieces.*Fix: data\.template=alpaca"):
        resolve_template(plain, "chatml")
    assert resolve_template(chat_tokenizer, "chatml").name == "chatml"
    assert resolve_template(plain, "alpaca").source == "data.template=alpaca (the tokenizer has none)"
    trained, _ = trained_text(plain, TURNS, NAMED["alpaca"])
    assert trained == "It is 4.<eos>It is 6.<eos>"
    path = tmp_path / "mine.jinja"
    path.write_text(CHATML)
    assert resolve_template(chat_tokenizer, str(path)).text == CHATML
    with pytest.raises(ValueError, match=r"template='vicuna'\): not auto, a named template"):
        resolve_template(plain, "vicuna")


def test_generation_stops_at_the_templates_end_of_turn_token(chat_tokenizer):
    ids = turn_end_ids(chat_tokenizer, resolve_template(chat_tokenizer, "auto"))
    assert ids == [chat_tokenizer.eos_token_id, chat_tokenizer.convert_tokens_to_ids("<|im_end|>")]
    plain = tiny_tokenizer()
    assert turn_end_ids(plain, resolve_template(plain, "alpaca")) == [plain.eos_token_id]
