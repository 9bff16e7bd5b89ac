"""A deterministic, resumable, DDP-aware sampler that serves batches from the easiest allowed samples.

The functional core is :func:`shard_of_allowed` and :func:`batch_for`: given the easiest-first
``order``, how many samples are allowed, the epoch, the batch number and the rank, they return the
batch's dataset indices, with no hidden state. The sampler only walks them, counts what training has
consumed, and saves that count, so a run resumed mid-epoch sees exactly the batches of an
uninterrupted run.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DistributedSampler

from lit_speed.curriculum.pacing import allowed_count


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The shuffle of epoch ``epoch``: identical on every rank (same seed), different every epoch."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))


def shard_of_allowed(order: torch.Tensor, n_allowed: int, perm: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s share of the ``n_allowed`` easiest samples, in this epoch's shuffled order.

    The allowed set ``order[:n_allowed]`` is put in the order of ``perm`` and dealt round-robin, so the
    ``world_size`` shards are disjoint, together cover the allowed set, and differ in size by at most one.
    """
    allowed = torch.zeros(len(order), dtype=torch.bool)
    allowed[order[:n_allowed]] = True
    return perm[allowed[perm]][rank::world_size]


def batch_for(shard: torch.Tensor, batch: int, size: int, batch_size: int) -> torch.Tensor:
    """Batch ``batch`` of a walk through ``shard``, wrapping around when the shard is smaller than the epoch.

    With the full set allowed this is a plain shuffled epoch: every sample once, in ``perm`` order.
    """
    return shard[(batch * batch_size + torch.arange(size)) % len(shard)]


class CurriculumSampler(DistributedSampler):
    """Yields one list of dataset indices per batch, drawn from the currently allowed (easiest) samples.

    It subclasses ``DistributedSampler`` so Lightning leaves it in place under DDP instead of wrapping it
    (``_requires_distributed_sampler`` checks ``isinstance(sampler, DistributedSampler)``); use it with
    ``DataLoader(dataset, sampler=sampler, batch_size=None)``. Every rank serves the same number of batches
    per epoch: ``ceil(len / world_size)`` samples, like ``DistributedSampler``.

    Args:
        order: Dataset indices from easiest to hardest (a permutation of ``range(len)``).
        batch_size: Samples per batch on this rank.
        fraction_at: Maps the global training-batch number (0-based, counted across epochs) to the allowed share.
        seed: Seed of the per-epoch shuffle; the same on every rank.
        rank: This process's rank.
        world_size: Number of processes.
        drop_last: Drop the last, smaller batch of each epoch.

    Example::

        sampler = CurriculumSampler(order, 32, lambda g: pacing_fraction("linear", g / 100, 0.25))
        loader = DataLoader(dataset_indexed_by_lists, sampler=sampler, batch_size=None)
    """

    def __init__(self, order: torch.Tensor, batch_size: int, fraction_at: Callable[[int], float], seed: int = 0,
                 rank: int = 0, world_size: int = 1, drop_last: bool = False) -> None:
        order = torch.as_tensor(order, dtype=torch.long)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        super().__init__(range(len(order)), num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                         drop_last=False)
        self.order = order.clone()
        self.batch_size = batch_size
        self.fraction_at = fraction_at
        self.drop_batch = drop_last
        per_rank = math.ceil(len(order) / world_size)
        self.per_rank = per_rank
        self.batches_per_epoch = per_rank // batch_size if drop_last else math.ceil(per_rank / batch_size)
        # consumption, advanced by the DataModule when training really uses a batch (not when it is prefetched)
        self.consumed_epoch = 0
        self.consumed_in_epoch = 0
        self.consumed_total = 0

    def __len__(self) -> int:
        return self.batches_per_epoch

    def n_allowed(self, global_batch: int) -> int:
        return allowed_count(len(self.order), self.fraction_at(global_batch), minimum=self.num_replicas)

    def batch_indices(self, epoch: int, batch: int, global_batch: int) -> torch.Tensor:
        """Indices of batch ``batch`` of ``epoch`` on this rank (a pure function of its arguments and the config)."""
        perm = epoch_permutation(len(self.order), self.seed, epoch)
        shard = shard_of_allowed(self.order, self.n_allowed(global_batch), perm, self.rank, self.num_replicas)
        size = min(self.batch_size, self.per_rank - batch * self.batch_size)
        return batch_for(shard, batch, size, self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        if self.epoch == self.consumed_epoch:
            start = self.consumed_in_epoch  # resuming this epoch: skip what training already used
        else:
            self.consumed_epoch, self.consumed_in_epoch, start = self.epoch, 0, 0
        epoch, first_global = self.epoch, self.consumed_total - start
        perm = epoch_permutation(len(self.order), self.seed, epoch)
        shard, shard_n = None, -1
        for b in range(start, self.batches_per_epoch):
            n = self.n_allowed(first_global + b)
            if n != shard_n:  # the shard only changes when the allowed count does
                shard, shard_n = shard_of_allowed(self.order, n, perm, self.rank, self.num_replicas), n
            size = min(self.batch_size, self.per_rank - b * self.batch_size)
            yield batch_for(shard, b, size, self.batch_size).tolist()

    def mark_consumed(self) -> None:
        """Record that training used one more batch of the current epoch."""
        self.consumed_in_epoch += 1
        self.consumed_total += 1

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.consumed_epoch, "batch_in_epoch": self.consumed_in_epoch,
                "batches_total": self.consumed_total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consumed_epoch = int(state.get("epoch", 0))
        self.consumed_in_epoch = int(state.get("batch_in_epoch", 0))
        self.consumed_total = int(state.get("batches_total", 0))
        if state.get("epoch_done", False):  # saved at the end of an epoch: the next batch opens the next epoch
            self.consumed_epoch, self.consumed_in_epoch = self.consumed_epoch + 1, 0
        # Lightning iterates the loader once before it calls set_epoch on resume, so start in the saved epoch
        self.set_epoch(self.consumed_epoch)
