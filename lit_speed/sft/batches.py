"""The training and validation sets of tokenized examples as ``get_batch(indices)`` datasets, and the two layouts.

:class:`Layout` is one way to cut an epoch into batches: ``packed`` (items are rows of examples, best fit) or
``padded`` (items are examples, batches grouped by length). Both are computed from the lengths alone, so their cost
in positions is known before anything runs (:meth:`Layout.positions` for a whole epoch).
"""
from __future__ import annotations

from functools import cached_property, partial
from typing import Sequence

import numpy as np
import torch

from lit_speed.sft.packing import collate_packed, collate_padded, grouped_batches, pack_best_fit
from lit_speed.sft.tokenized import TokenizedExamples

#: length-grouped batching sorts runs of this many batches by length (Hugging Face's ``group_by_length`` uses 50)
GROUP_BATCHES = 64


class ExampleBatches(torch.utils.data.Dataset):
    """Examples (``padded``) or packed rows (``packed``) of ``examples``, collated a batch at a time."""

    def __init__(self, examples: TokenizedExamples, pad_id: int, rows: Sequence[Sequence[int]] | None = None) -> None:
        self.examples, self.pad_id, self.rows = examples, pad_id, rows

    def __len__(self) -> int:
        return len(self.rows) if self.rows is not None else len(self.examples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.get_batch([index])

    def get_batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        if self.rows is None:
            return collate_padded([self.examples.example(i) for i in indices], self.pad_id)
        return collate_packed([[self.examples.example(i) for i in self.rows[r]] for r in indices], self.pad_id)


class Layout:
    """An epoch of ``examples`` in batches of ``batch_size`` examples: ``padded`` (length-grouped), or ``packed`` into
    rows of ``capacity`` positions, as many rows per batch as hold ``batch_size`` examples on average.

    So both layouts make the same optimizer steps per epoch over the same examples per step (on average): choosing
    one is a matter of speed, not of the batch the optimizer sees (TRL's ``packing=True`` counts rows instead, and
    its steps hold several times the tokens).
    """

    def __init__(self, examples: TokenizedExamples, batch_size: int, capacity: int, packed: bool) -> None:
        self.examples, self.capacity, self.packed = examples, capacity, packed
        self.rows = pack_best_fit(examples.positions(), capacity) if packed else None
        self.batch_size = max(1, round(len(self.rows) * batch_size / max(len(examples), 1))) if packed else batch_size
        self.item_positions = (np.array([examples.positions()[r].sum() for r in self.rows]) if packed
                               else examples.positions())
        # the sampler's ``batching`` (one object: the sampler is rebuilt when it changes): length groups for
        # ``padded``, consecutive slices (None) for packed rows, which are all about as long
        self.batching = None if packed else partial(_grouped, self.item_positions, self.batch_size, GROUP_BATCHES)
        self.in_order = partial(in_order, self.batch_size)  # shuffle=False's batching (one object, as above)

    @property
    def name(self) -> str:
        return "packed" if self.packed else "padded"

    def __len__(self) -> int:
        return len(self.item_positions)

    def dataset(self, pad_id: int) -> ExampleBatches:
        return ExampleBatches(self.examples, pad_id, self.rows)

    @cached_property
    def epoch_batches(self) -> list[np.ndarray]:
        """The batches of one epoch in a fixed shuffle (what a shuffled epoch looks like, for counting); built once:
        the packing choice, the start-up table and the padding share all count from it."""
        order = np.random.default_rng(0).permutation(len(self)).tolist()
        batches = (_grouped(self.item_positions, self.batch_size, GROUP_BATCHES, order, 0) if not self.packed else
                   [order[b:b + self.batch_size] for b in range(0, len(order), self.batch_size)])
        return [np.asarray(b) for b in batches]

    def positions(self) -> tuple[int, int]:
        """``(positions computed, real positions)`` of one epoch: a batch computes ``items x its longest item``."""
        computed = sum(len(b) * int(self.item_positions[b].max()) for b in self.epoch_batches)
        return computed, int(self.item_positions.sum())

    def padding_share(self) -> float:
        computed, real = self.positions()
        return 1.0 - real / max(computed, 1)


def in_order(batch_size: int, indices: list[int], seed: int) -> list[list[int]]:
    """``shuffle=False``'s batching: the indices in ascending order (the data's), consecutive batches."""
    ordered = sorted(indices)
    return [ordered[b:b + batch_size] for b in range(0, len(ordered), batch_size)]


def _grouped(lengths: np.ndarray, batch_size: int, group: int, order: list[int], seed: int) -> list[list[int]]:
    return grouped_batches(order, lengths, batch_size, group, torch.Generator().manual_seed(int(seed) % 2**63))
