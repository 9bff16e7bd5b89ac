"""Format detection and the conversion of every format into turns (lit_speed.sft.formats)."""
from __future__ import annotations

import pytest

from lit_speed.sft.formats import RecordError, detect_format, to_conversation


@pytest.mark.parametrize(("columns", "expected"), [
    (["messages"], "messages"), (["conversations", "id"], "messages"), (["prompt", "completion"], "prompt_completion"),
    (["prompt", "response", "system"], "prompt_response"), (["instruction", "input", "output"], "instruction"),
    (["text", "meta"], "text")])
def test_each_format_is_detected_from_its_columns(columns, expected):
    detected = detect_format(columns)
    assert detected.format == expected and detected.how == "detected"


def test_a_mapping_renames_columns_and_the_named_format_is_checked():
    detected = detect_format(["question", "answer"], columns={"prompt": "question", "completion": "answer"})
    assert detected.format == "prompt_completion" and detected.columns == {"prompt": "question", "completion": "answer"}
    turns = to_conversation({"question": "Q?", "answer": "A."}, detected)
    assert turns == [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}]
    assert detect_format(["prompt", "completion", "text"], format="text").format == "text"


def test_no_known_format_names_the_columns_found_and_the_mapping_option():
    with pytest.raises(ValueError, match=r"no known format in the columns \['question', 'answer'\].*Fix: "
                                         r"data\.columns=\{prompt: <your prompt column>"):
        detect_format(["question", "answer"])
    with pytest.raises(ValueError, match=r"columns=\{'prompt': 'q'\}\): the data has no column \['q'\] \(its columns: "
                                         r"\['question'\]\)"):
        detect_format(["question"], columns={"prompt": "q"})
    with pytest.raises(ValueError, match=r"format=messages\): the data has no column \['messages'\]"):
        detect_format(["prompt", "completion"], format="messages")


def test_alpaca_input_joins_the_instruction_and_a_system_column_leads():
    detected = detect_format(["instruction", "input", "output", "system"])
    turns = to_conversation({"instruction": "Sum.", "input": "2 3", "output": "5", "system": "Be brief."}, detected)
    assert turns == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sum.\n\n2 3"},
                     {"role": "assistant", "content": "5"}]
    assert to_conversation({"instruction": "Hi.", "input": "", "output": "Hello.", "system": ""}, detected)[0] == \
        {"role": "user", "content": "Hi."}


def test_sharegpt_turns_are_renamed_and_trl_conversational_prompt_completion_is_joined():
    detected = detect_format(["conversations"])
    turns = to_conversation({"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]},
                            detected)
    assert turns == [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    pc = detect_format(["prompt", "completion"])
    turns = to_conversation({"prompt": [{"role": "user", "content": "Q"}],
                             "completion": [{"role": "assistant", "content": "A"}]}, pc)
    assert [t["role"] for t in turns] == ["user", "assistant"]


@pytest.mark.parametrize(("record", "message"), [
    ({"messages": [{"role": "user", "content": "Q"}]}, r"no assistant turn \(roles \['user'\]\)"),
    ({"messages": [{"role": "user", "content": "Q"}, {"role": "bot", "content": "A"}]},
     r"messages\[1\] has the role 'bot', not one of \['system', 'user', 'assistant'\]"),
    ({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "  "}]},
     r"turn 1 \(assistant\) is an empty response"),
    ({"messages": "Q: hi"}, r"messages is a str, not a list of turns"),
    ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "A"}]},
     r"messages\[0\]\.content is a int, not text")])
def test_records_that_cannot_train_are_refused_naming_the_turn(record, message):
    with pytest.raises(RecordError, match=message):
        to_conversation(record, detect_format(["messages"]))


def test_an_empty_completion_and_an_empty_text_are_refused():
    with pytest.raises(RecordError, match="empty response"):
        to_conversation({"prompt": "Q", "completion": ""}, detect_format(["prompt", "completion"]))
    with pytest.raises(RecordError, match="text is empty"):
        to_conversation({"text": " "}, detect_format(["text"]))
