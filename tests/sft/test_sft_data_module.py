"""SFTDataModule alone: what it reads, masks, counts and holds out, its two layouts, and its resumable order."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lit_speed.sft import SFTDataModule
from lit_speed.sft.loading import DataError
from lit_speed.sft.val_split import held_out_rows
from tests.helpers.sft import write_jsonl


def module(source, model, tmp_path, **kwargs):
    kwargs.setdefault("max_length", 256)
    dm = SFTDataModule(str(source), tokenizer=str(model), cache_dir=str(tmp_path / "cache"), **kwargs)
    dm.setup()
    return dm


@pytest.mark.parametrize("fmt", ["chat", "prompt_completion", "instruction"])
def test_every_format_trains_only_on_responses(examples, chat_model, tmp_path, fmt):
    dm = module(examples[fmt], chat_model, tmp_path, packing=False, max_length=512)
    assert dm.train_examples.counts["overlong"] == 0
    rows = dm.describe()
    assert rows["data"].startswith(f"sft {examples[fmt]}: 38 train / 2 val examples, "
                                   f"{'messages' if fmt == 'chat' else fmt} (detected;")
    assert rows["template"] == "the tokenizer's own"
    batch = next(iter(dm.train_dataloader()))
    tok = dm.tokenizer
    for ids, labels in zip(batch["input_ids"], batch["labels"]):
        trained = tok.decode(labels[labels != -100])
        assert trained.count("<|im_end|>") == (2 if fmt == "chat" else 1) and "<|im_start|>" not in trained
        assert "What does the Python" not in trained and "Explain what" not in trained  # the prompts are masked


def test_truncation_and_dropping_are_counted_and_an_empty_run_is_refused(examples, chat_model, tmp_path):
    full = module(examples["prompt_completion"], chat_model, tmp_path, max_length=512)
    longest = int(full.train_examples.lengths.max())
    cut = module(examples["prompt_completion"], chat_model, tmp_path, max_length=longest - 20)
    assert cut.train_examples.counts["truncated"] >= 1 and cut.train_examples.lengths.max() == longest - 20
    assert f"{cut.train_examples.counts['overlong']} longer (truncated)" in cut.describe()["lengths"]
    dropped = module(examples["prompt_completion"], chat_model, tmp_path, max_length=longest - 20, overlong="drop")
    assert len(dropped.train_examples) == len(cut.train_examples) - dropped.train_examples.counts["dropped_overlong"]
    with pytest.raises(DataError, match=r"^data\.source: no training example is left of 38: 38 longer than "
                                        r"max_length=8 were dropped \(data\.overlong=drop\)\. Fix: "
                                        r"data\.overlong=truncate, or a larger data\.max_length$"):
        module(examples["prompt_completion"], chat_model, tmp_path, max_length=8, overlong="drop", val_size=2)


def test_held_out_rows_are_the_same_every_run_and_a_validation_file_replaces_them(examples, chat_model, tmp_path):
    assert held_out_rows("auto", 40).tolist() == held_out_rows("auto", 40).tolist() and len(held_out_rows(0.25, 40)) == 10
    torch.manual_seed(1)
    a = module(examples["chat"], chat_model, tmp_path, val_size=5)
    torch.manual_seed(2)
    b = module(examples["chat"], chat_model, tmp_path, val_size=5)
    assert a.val_examples.index.tolist() == b.val_examples.index.tolist() and len(a.train_examples) == 35
    c = module(examples["chat"], chat_model, tmp_path, val_source=str(examples["chat"]))
    assert len(c.train_examples) == 40 and len(c.val_examples) == 40
    with pytest.raises(ValueError, match=r"val_size=40\): holds out 40 of 40 examples, none left to train on"):
        module(examples["chat"], chat_model, tmp_path, val_size=40)
    with pytest.raises(ValueError, match=r"val_size=-1\): must be auto, a number of examples >= 1"):
        SFTDataModule("x.jsonl", tokenizer=str(chat_model), cache_dir=str(tmp_path), val_size=-1)


@pytest.mark.parametrize("packing", [True, False])
def test_a_restored_order_serves_the_batches_the_uninterrupted_epoch_serves(examples, chat_model, tmp_path, packing):
    torch.manual_seed(0)
    dm = module(examples["chat"], chat_model, tmp_path, packing=packing, batch_size=3)
    loader = dm.train_dataloader()
    batches = []
    for i, batch in enumerate(loader):
        dm.train_order.sampler.mark_used()
        batches.append(batch)
        if i == 2:
            state = dm.train_order.state_dict(None) | {"epoch_done": False}
    assert len(batches) > 5
    other = module(examples["chat"], chat_model, tmp_path, packing=packing, batch_size=3)
    other.load_state_dict({"train_order": state, "packing": {"packed": packing, "reason": "test"}})
    rest = list(other.train_dataloader())
    assert len(rest) == len(batches) - 3
    for got, want in zip(rest, batches[3:]):
        assert all(torch.equal(got[k], want[k]) for k in want)
    assert other.layout.packed is packing and "kept from the checkpoint" in other.packing_reason


def test_packed_rows_hold_the_examples_of_length_grouped_batches_with_less_padding(examples, chat_model, tmp_path):
    dm = module(examples["chat"], chat_model, tmp_path, packing=True, batch_size=2, max_length=512)
    padded = module(examples["chat"], chat_model, tmp_path, packing=False, batch_size=2, max_length=512)
    trained = [sum(int((b["labels"] != -100).sum()) for b in d.train_dataloader()) for d in (dm, padded)]
    assert trained[0] == trained[1] == dm.train_examples.counts["trained_tokens"]
    assert max(dm.layout.padding_share(), padded.layout.padding_share()) < 0.2
    auto = module(examples["chat"], chat_model, tmp_path, batch_size=2, max_length=512)
    auto.train_dataloader()  # alone (no model to time): the layout that computes fewer positions
    assert auto.packing_reason == "fewer positions to compute (not timed: no model)"
    assert auto.layout.positions()[0] == min(dm.layout.positions()[0], padded.layout.positions()[0])


def test_the_bundled_stdlib_examples_and_a_named_template_for_a_base_tokenizer(plain_model, tmp_path):
    dm = module("stdlib", plain_model, tmp_path, template="alpaca", max_length=128)
    assert len(dm.train_examples) > 100 and "data.template=alpaca" in dm.describe()["template"]
    assert dm.tokenizer.chat_template and "### Response:" in dm.tokenizer.chat_template  # exported with the model
    assert dm.prompts and dm.prompts[0].reference


def test_a_record_that_cannot_train_is_named_by_file_and_line(chat_model, tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(5)]
    rows[3]["messages"][1]["content"] = ""
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    with pytest.raises(DataError, match=rf"^data\.source: {path} line 4: turn 1 \(assistant\) is an empty response\. "
                                        r"Fix: correct or remove that record$"):
        module(path, chat_model, tmp_path)
    assert not list((tmp_path / "cache").glob("sft-tokens-*.arrow")), "a failed map left a cache file behind"
    np.testing.assert_equal(len(rows), 5)


def test_the_largest_batch_is_what_any_epoch_of_the_layout_can_draw(examples, chat_model, tmp_path):
    """What the memory estimate reads before the weights load: rows x the longest row (packed), examples x the
    longest example (padded), the larger of both for packing=auto; never above batch_size x max_length, and for
    packed rows that hold batch_size examples on average, well below it."""
    from lit_speed.sft.batches import Layout

    packed, padded, auto = (module(examples["chat"], chat_model, tmp_path, packing=p, max_length=512, batch_size=4)
                            for p in (True, False, "auto"))
    for dm, flag in ((packed, True), (padded, False)):
        layout = Layout(dm.train_examples, dm.batch_size, dm.max_length, flag)
        drawn = max(len(b) * int(layout.item_positions[b].max()) for b in layout.epoch_batches)
        assert drawn <= dm.largest_batch_positions() == layout.batch_size * int(layout.item_positions.max())
    assert auto.largest_batch_positions() == max(packed.largest_batch_positions(), padded.largest_batch_positions())
    assert packed.largest_batch_positions() < 4 * 512


def test_the_memory_estimate_sizes_an_sft_step_by_the_largest_batch(make_cfg, examples, chat_model, tmp_path):
    """``batch_size x max_length`` (4 x 512 here) overstated a packed step: 0.5B ``experiment=sft_lora`` was
    predicted at x1.59 of its peak RSS."""
    from lit_speed.run.memory_fit import fit_check, fit_levers
    from tests.sft.test_sft_train import overrides

    cfg = make_cfg(overrides(chat_model, examples["chat"], tmp_path, "data.batch_size=4", "data.packing=true"))
    largest = module(examples["chat"], chat_model, tmp_path, packing=True, max_length=512,
                     batch_size=4).largest_batch_positions()
    facts = fit_check.run_facts(cfg, fit_check.hf_folder(cfg), fit_levers.configured_levers(cfg))
    assert facts.tokens == largest < 4 * 512
