"""Batching tokenized examples with little padding: packed rows or length-grouped batches, and their collation.

Each example is its token ids and its trained mask; as training data it is ``input = ids[:-1]`` and
``target = ids[1:]`` (``-100`` where the target token is not trained), so an example of ``n`` tokens fills ``n - 1``
positions.

- :func:`pack_best_fit`: best-fit-decreasing bins of at most ``capacity`` positions (TRL's ``pack_dataset(...,
  strategy="bfd")``): each example goes whole into the fullest row it fits. :func:`collate_packed` lays the examples
  of a row side by side with their positions restarting at 0; the model then keeps attention inside each example
  (Hugging Face builds a block-diagonal causal mask from restarting ``position_ids``).
- :func:`grouped_batches`: a shuffled epoch cut into groups of ``group`` batches, each group sorted by length, so
  a batch pads to a length close to its examples' (Hugging Face's ``group_by_length``).
  :func:`collate_padded` pads on the right; ``attention_mask`` marks the real positions.
"""
from __future__ import annotations

from collections import defaultdict, deque
from typing import Sequence

import numpy as np
import torch

IGNORE = -100


def pack_best_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Rows of example indices, each holding at most ``capacity`` positions, by best fit decreasing.

    Longest example first, each into the row with the least free space that still holds it (a new row when none
    does): a segment tree over free-space values finds that row in ``O(log capacity)`` (TRL's ``_pack_bfd``).

    Raises:
        ValueError: An example longer than ``capacity``, or shorter than 1.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and (lengths.max() > capacity or lengths.min() < 1):
        raise ValueError(f"example lengths must be 1..{capacity} positions, got {int(lengths.min())}.."
                         f"{int(lengths.max())}")
    size = 1 << max(capacity - 1, 0).bit_length()
    tree = [0] * (2 * size)  # tree[leaf of space s] = s while some row has s free; inner nodes: the max below

    def mark(space: int, present: bool) -> None:
        i = size + space - 1
        tree[i] = space if present else 0
        while i > 1:
            i >>= 1
            left, right = tree[2 * i], tree[2 * i + 1]
            tree[i] = left if left >= right else right

    rows: list[list[int]] = []
    by_space: dict[int, deque[int]] = defaultdict(deque)  # free space -> rows with that much, oldest first
    for index in np.argsort(-lengths, kind="stable").tolist():
        need = int(lengths[index])
        if tree[1] >= need:
            i = 1
            while i < size:  # the leftmost leaf >= need: the smallest free space that fits
                i = 2 * i if tree[2 * i] >= need else 2 * i + 1
            space = tree[i]
            row = by_space[space].popleft()
            if not by_space[space]:
                mark(space, False)
        else:
            row, space = len(rows), capacity
            rows.append([])
        rows[row].append(index)
        left = space - need
        if left > 0:
            if not by_space[left]:
                mark(left, True)
            by_space[left].append(row)
    return rows


def grouped_batches(order: Sequence[int], lengths: Sequence[int], batch_size: int, group: int,
                    generator: torch.Generator | None = None) -> list[list[int]]:
    """``order`` cut into batches of ``batch_size``, each run of ``group`` batches sorted by length (longest first)
    and then put back in a random order (``generator``), so neighbouring batches do not grow or shrink in step."""
    order = list(order)
    lengths = np.asarray(lengths)
    span = batch_size * max(group, 1)
    batches: list[list[int]] = []
    for start in range(0, len(order), span):
        chunk = sorted(order[start:start + span], key=lambda i: -int(lengths[i]))
        part = [chunk[b:b + batch_size] for b in range(0, len(chunk), batch_size)]
        shuffled = torch.randperm(len(part), generator=generator).tolist() if generator is not None else range(len(part))
        batches += [part[i] for i in shuffled]
    return batches


def _pair(ids: np.ndarray, trained: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Input and target of one example: ``ids[:-1]``, and ``ids[1:]`` with ``-100`` where not trained."""
    return ids[:-1], np.where(trained[1:], ids[1:], IGNORE)


def collate_padded(examples: Sequence[tuple[np.ndarray, np.ndarray]], pad_id: int,
                   pad_to_multiple_of: int = 1) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``labels`` (``-100`` on padding and untrained targets) and ``attention_mask``."""
    pairs = [_pair(ids, trained) for ids, trained in examples]
    width = max(len(x) for x, _ in pairs)
    width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    inputs = np.full((len(pairs), width), pad_id, dtype=np.int64)
    labels = np.full((len(pairs), width), IGNORE, dtype=np.int64)
    mask = np.zeros((len(pairs), width), dtype=np.int64)
    for row, (x, y) in enumerate(pairs):
        inputs[row, :len(x)], labels[row, :len(y)], mask[row, :len(x)] = x, y, 1
    return {"input_ids": torch.from_numpy(inputs), "labels": torch.from_numpy(labels),
            "attention_mask": torch.from_numpy(mask)}


def collate_packed(rows: Sequence[Sequence[tuple[np.ndarray, np.ndarray]]], pad_id: int,
                   width: int | None = None) -> dict[str, torch.Tensor]:
    """Packed rows: examples side by side, ``position_ids`` restarting at 0 for each, right padding to the longest
    row (or ``width``); ``attention_mask`` marks real positions (1), not example boundaries."""
    laid = []
    for row in rows:
        pairs = [_pair(ids, trained) for ids, trained in row]
        laid.append((np.concatenate([x for x, _ in pairs]), np.concatenate([y for _, y in pairs]),
                     np.concatenate([np.arange(len(x)) for x, _ in pairs])))
    width = width or max(len(x) for x, _, _ in laid)
    inputs = np.full((len(laid), width), pad_id, dtype=np.int64)
    labels = np.full((len(laid), width), IGNORE, dtype=np.int64)
    mask = np.zeros((len(laid), width), dtype=np.int64)
    # padding continues the last example's positions: no new "example" starts there, so the mask adds no block
    positions = np.zeros((len(laid), width), dtype=np.int64)
    for r, (x, y, p) in enumerate(laid):
        n = len(x)
        inputs[r, :n], labels[r, :n], mask[r, :n], positions[r, :n] = x, y, 1, p
        positions[r, n:] = p[-1] + 1 + np.arange(width - n)
    return {"input_ids": torch.from_numpy(inputs), "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(positions), "attention_mask": torch.from_numpy(mask)}


def padding_share(batch: dict[str, torch.Tensor]) -> float:
    """Positions of the batch that are padding (``attention_mask == 0``), as a share of all positions."""
    mask = batch["attention_mask"]
    return float(1.0 - mask.sum().item() / max(mask.numel(), 1))
