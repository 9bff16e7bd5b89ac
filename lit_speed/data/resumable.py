"""A shuffled batch sampler that resumes mid-epoch: the batches after a resume are the uninterrupted run's.

A ``RandomSampler`` draws its epoch's seed from the global torch RNG when its iterator is built; a run
resumed mid-epoch builds a new iterator, draws a new seed and serves a different epoch (Lightning warns
that the loader "is not resumable"). :class:`ResumableShuffleSampler` draws the seed the same way, so an
uninterrupted run serves exactly what ``shuffle=True`` serves, but it saves the seed and how many batches
training has used, and a resumed iterator goes on from there. The DataModules count a batch as used when
it is transferred for training (:meth:`ResumableShuffle.mark_used`), not when a loader prefetches it.
"""
from __future__ import annotations

import math
import os
from typing import Any, Callable, Iterator

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DistributedSampler, Sampler

from lit_speed.data.pipeline import apply_batch_transform


def draw_seed() -> int:
    """A seed drawn from the global torch RNG exactly as ``RandomSampler`` draws its epoch's seed."""
    return int(torch.empty((), dtype=torch.int64).random_().item())


class ResumableShuffleSampler(DistributedSampler):
    """Yields one list of indices per batch of a shuffled epoch; resumes at the first batch training did not use.

    A ``DistributedSampler`` subclass so that Lightning leaves it in place under DDP: each rank takes every
    ``world_size``-th index of the epoch's permutation (padded by wrapping, as ``DistributedSampler`` does).
    On several processes the permutation is ``DistributedSampler``'s own (``randperm`` seeded with ``seed + epoch``,
    no draw from the global RNG, whose streams may differ between ranks), so every rank agrees on it and the
    batches are those plain DDP serves for ``shuffle=True``; on one process the epoch seed is drawn like
    ``RandomSampler`` draws it. Use with ``DataLoader(BatchFetch(dataset), sampler=sampler, batch_size=None)``.

    Args:
        n: Dataset size.
        batch_size: Samples per batch on this rank.
        drop_last: Drop each epoch's last, smaller batch.
        rank: This process's rank.
        world_size: Number of processes.
        seed: The shared seed of the permutations on several processes (Lightning passes ``PL_GLOBAL_SEED`` to the
            ``DistributedSampler`` it injects); unused on one process.
        batching: ``(this rank's indices in epoch order, epoch seed) -> batches``, instead of consecutive slices of
            ``batch_size`` (e.g. length-grouped batches); it must return as many batches as the slices would be.
    """

    def __init__(self, n: int, batch_size: int, drop_last: bool = False, rank: int = 0, world_size: int = 1,
                 seed: int = 0, batching: Callable[[list[int], int], list[list[int]]] | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        super().__init__(range(n), num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=False)
        self.n, self.batch_size, self.drop_batch = n, batch_size, drop_last
        self.per_rank = math.ceil(n / world_size)
        self.batches_per_epoch = self.per_rank // batch_size if drop_last else math.ceil(self.per_rank / batch_size)
        self.batching = batching
        self.epoch_seed: int | None = None  # the seed the current epoch's permutation was drawn with
        self.used_epoch = 0
        self.used_in_epoch = 0
        self._resume = False  # the next iterator of epoch ``used_epoch`` goes on from ``used_in_epoch``

    def __len__(self) -> int:
        return self.batches_per_epoch

    def __iter__(self) -> Iterator[list[int]]:
        if self._resume and self.epoch == self.used_epoch and self.epoch_seed is not None:
            start = self.used_in_epoch
        else:
            seed = draw_seed() if self.num_replicas == 1 else self.seed + self.epoch
            self._resume, self.epoch_seed, self.used_epoch, self.used_in_epoch, start = False, seed, self.epoch, 0, 0
        perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch_seed))
        if self.num_replicas > 1:
            padded = torch.cat([perm, perm[: self.per_rank * self.num_replicas - self.n]])
            perm = padded[self.rank::self.num_replicas]
        if self.batching is not None:
            batches = self.batching(perm.tolist(), self.epoch_seed)
            if len(batches) < self.batches_per_epoch:
                raise ValueError(f"batching made {len(batches)} batches of an epoch of {self.batches_per_epoch}")
            yield from batches[start:self.batches_per_epoch]
            return
        for b in range(start, self.batches_per_epoch):
            yield perm[b * self.batch_size: (b + 1) * self.batch_size].tolist()

    def mark_used(self) -> None:
        """Record that training used one more batch of the current epoch."""
        self.used_in_epoch += 1

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.used_epoch, "batch_in_epoch": self.used_in_epoch, "epoch_seed": self.epoch_seed,
                "size": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.used_epoch = int(state.get("epoch", 0))
        self.used_in_epoch = int(state.get("batch_in_epoch", 0))
        self.epoch_seed = state.get("epoch_seed")
        # saved at an epoch's end: the next epoch draws its seed as the uninterrupted run did
        self._resume = not state.get("epoch_done", False) and self.epoch_seed is not None
        # Lightning iterates the loader once before it calls set_epoch on resume, so start in the saved epoch
        self.set_epoch(self.used_epoch)


class ResumableShuffle:
    """The part of a DataModule that owns its resumable training order (see :class:`ResumableShuffleSampler`).

    The DataModule creates the sampler with :meth:`sampler_for`, calls :meth:`mark_used` for every training
    batch it transfers, and returns :meth:`state_dict` / passes :meth:`load_state_dict` through.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.sampler: ResumableShuffleSampler | None = None
        self._pending: dict[str, Any] | None = None

    def sampler_for(self, n: int, batch_size: int, drop_last: bool, trainer: "pl.Trainer | None",
                    batching: Callable[[list[int], int], list[list[int]]] | None = None) -> Sampler:
        """The training batch sampler, resumable mid-epoch on one process and on several (where it serves the
        batches Lightning's injected ``DistributedSampler`` would: seeded with ``PL_GLOBAL_SEED`` + epoch);
        ``batching``: see :class:`ResumableShuffleSampler`."""
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        s = self.sampler
        if s is None or (s.n, s.batch_size, s.drop_batch, s.rank, s.num_replicas, s.seed, s.batching) != (
                n, batch_size, drop_last, rank, world, seed, batching):
            self.sampler = ResumableShuffleSampler(n, batch_size, drop_last, rank, world, seed, batching)
            if self._pending is not None:
                self._load(self._pending)
        return self.sampler

    def mark_used(self, trainer: "pl.Trainer | None") -> None:
        if self.sampler is not None and trainer is not None and trainer.training:
            self.sampler.mark_used()

    def state_dict(self, trainer: "pl.Trainer | None") -> dict[str, Any]:
        if self.sampler is None:
            return {}
        state = self.sampler.state_dict()
        limit = getattr(trainer, "num_training_batches", None) if trainer is not None else None
        limit = self.sampler.batches_per_epoch if not isinstance(limit, int) else limit
        state["epoch_done"] = state["batch_in_epoch"] >= limit
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self._pending = dict(state)
        if self.sampler is not None:
            self._load(self._pending)

    def _load(self, state: dict[str, Any]) -> None:
        if state.get("size", self.sampler.n) != self.sampler.n:
            raise ValueError(f"the checkpoint's {self.name} training order was over {state['size']} samples, this "
                             f"data has {self.sampler.n}; resume with the same data settings")
        self.sampler.load_state_dict(state)
        self._pending = None
        if not state.get("epoch_done", False):
            rank_zero_info(f"{self.name} training order resumed at epoch {self.sampler.used_epoch}, "
                           f"batch {self.sampler.used_in_epoch}")


class ResumableOrderHooks:
    """DataModule hooks for a ``self.train_order`` (:class:`ResumableShuffle`) and a ``self.batch_transform``.

    Mix in before ``pl.LightningDataModule``: every transferred training batch is marked used, the training order
    goes into the DataModule's ``state_dict`` (so Lightning saves it in each checkpoint) and comes back at resume.
    """

    train_order: ResumableShuffle
    batch_transform: Any
    trainer: "pl.Trainer | None"

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.train_order.mark_used(self.trainer)
        return apply_batch_transform(self.batch_transform, batch, self.trainer is not None and self.trainer.training)

    def state_dict(self) -> dict[str, Any]:
        return {"train_order": self.train_order.state_dict(self.trainer)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.train_order.load_state_dict(state_dict.get("train_order", {}))
