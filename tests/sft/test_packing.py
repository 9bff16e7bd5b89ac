"""Packing and length grouping (lit_speed.sft.packing): rows that fit, batches that pad little, and packed rows whose
examples do not see each other (the model's loss per example equals the example run alone)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lit_speed.sft.packing import IGNORE, collate_packed, collate_padded, grouped_batches, pack_best_fit


def reference_best_fit(lengths, capacity):
    """Best fit decreasing the slow way: each example into the row with the least room that holds it."""
    rows, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fits = [r for r in range(len(rows)) if room[r] >= lengths[i]]
        r = min(fits, key=lambda r: room[r]) if fits else None
        if r is None:
            rows.append([]), room.append(capacity)
            r = len(rows) - 1
        rows[r].append(i)
        room[r] -= lengths[i]
    return rows


def test_best_fit_matches_trls_example_and_the_slow_reference():
    assert pack_best_fit([4, 2, 3, 1], 4) == [[0], [2, 3], [1]]  # TRL's pack_dataset docstring: [[1..4], [8..11], [6, 7]]
    rng = np.random.default_rng(0)
    for _ in range(20):
        lengths = rng.integers(1, 64, rng.integers(1, 200)).tolist()
        rows = pack_best_fit(lengths, 64)
        assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
        assert max(sum(lengths[i] for i in r) for r in rows) <= 64
        # rows with equal room are interchangeable, so the fills (not the groupings) are what best fit decides
        fills = sorted(sum(lengths[i] for i in r) for r in rows)
        assert fills == sorted(sum(lengths[i] for i in r) for r in reference_best_fit(lengths, 64))
    with pytest.raises(ValueError, match=r"example lengths must be 1\.\.8 positions, got 1\.\.9"):
        pack_best_fit([1, 9], 8)


def test_length_groups_hold_every_example_once_and_pad_less_than_random_batches():
    rng = np.random.default_rng(1)
    lengths = rng.integers(5, 500, 640)
    order = rng.permutation(640).tolist()
    batches = grouped_batches(order, lengths, 8, 16, torch.Generator().manual_seed(0))
    assert sorted(i for b in batches for i in b) == list(range(640)) and len(batches) == 80

    def padded(bs):
        return sum(len(b) * lengths[b].max() for b in map(np.asarray, bs))

    random_batches = [order[i:i + 8] for i in range(0, 640, 8)]
    assert padded(batches) < 0.8 * padded(random_batches)
    again = grouped_batches(order, lengths, 8, 16, torch.Generator().manual_seed(0))
    assert again == batches  # the epoch seed decides the order: a resumed run serves the same batches


def example(ids, trained):
    return np.asarray(ids, dtype=np.int64), np.asarray(trained, dtype=bool)


def test_collated_rows_shift_targets_mask_prompts_and_restart_positions():
    a, b = example([5, 6, 7, 8], [0, 0, 1, 1]), example([9, 10, 11], [0, 1, 1])
    padded = collate_padded([a, b], pad_id=0)
    assert padded["input_ids"].tolist() == [[5, 6, 7], [9, 10, 0]]
    assert padded["labels"].tolist() == [[IGNORE, 7, 8], [10, 11, IGNORE]]
    assert padded["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    packed = collate_packed([[a, b]], pad_id=0, width=7)
    assert packed["input_ids"].tolist() == [[5, 6, 7, 9, 10, 0, 0]]
    # example a's last input (7) predicts its own 8, never b's first token
    assert packed["labels"].tolist() == [[IGNORE, 7, 8, 10, 11, IGNORE, IGNORE]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3]]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_examples_give_each_example_its_own_loss(tmp_path, arch):
    from lit_speed.models.hf_causal_lm import HFCausalLM
    from tests.helpers.tiny_hf import save_tiny_causal_lm

    model = HFCausalLM(str(save_tiny_causal_lm(tmp_path / arch, arch=arch))).eval()
    rng = np.random.default_rng(3)
    examples = [example(rng.integers(3, 250, n), rng.random(n) > 0.3) for n in (17, 9, 23)]

    def per_example(batch, spans):
        extra = {"position_ids": batch["position_ids"]} if "position_ids" in batch else {}
        with torch.no_grad():
            logits = model(batch["input_ids"], **extra)
        losses = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE,
                                 reduction="none").view(batch["labels"].shape)
        return [losses[row, start:end].sum().item() for row, start, end in spans]

    alone = [per_example(collate_padded([e], 0), [(0, 0, len(e[0]) - 1)])[0] for e in examples]
    spans, start = [], 0
    for e in examples:
        spans.append((0, start, start + len(e[0]) - 1))
        start += len(e[0]) - 1
    packed = collate_packed([examples], pad_id=0, width=start + 5)
    assert per_example(packed, spans) == pytest.approx(alone, rel=1e-5, abs=1e-5)
    # the same row without restarting positions: attention crosses the boundaries and the later examples' losses move
    crossing = per_example({k: v for k, v in packed.items() if k != "position_ids"}, spans)
    assert crossing[0] == pytest.approx(alone[0], rel=1e-5)
    assert abs(crossing[1] - alone[1]) > 1e-3 and abs(crossing[2] - alone[2]) > 1e-3
