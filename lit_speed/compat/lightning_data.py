"""Private details of Lightning's fit-loop data handling (written against Lightning 2.6.6).

The fit loop keeps its training iterator in ``fit_loop._data_fetcher`` (a ``_DataFetcher``, or a
``_PrefetchDataFetcher`` holding ``batches`` ahead for loaders without a length), calls
``epoch_loop._on_before_fetch`` right before each fetch, and keeps the train dataloader's source in
``fit_loop._data_source``.
"""
from __future__ import annotations

from typing import Callable

import lightning.pytorch as pl

_SNAPSHOT_MARK = "_lit_speed_snapshot"  # marks our wrapper of _on_before_fetch, so it is installed once


def train_iterator_exists(trainer: "pl.Trainer | None") -> bool:
    """Whether the fit loop already holds a training-data iterator (``fit_loop._data_fetcher.iterator``)."""
    fetcher = getattr(getattr(trainer, "fit_loop", None), "_data_fetcher", None)
    return getattr(fetcher, "iterator", None) is not None


def recreate_train_iterator(trainer: "pl.Trainer") -> None:
    """``iter(fit_loop._data_fetcher)``, as ``_TrainingEpochLoop.on_run_start`` does at the start of an epoch."""
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is not None:
        iter(fetcher)


def restarted_after_an_epochs_last_batch(trainer: "pl.Trainer") -> bool:
    """Whether this fit resumed from a checkpoint written in ``on_train_batch_end`` of an epoch's last batch
    (e.g. ``ModelCheckpoint(every_n_train_steps=...)`` landing there). Lightning 2.6.6 ``FitLoop.reset`` then
    counts that epoch as done and goes on with the iterator ``FitLoop.setup_data`` built right after the
    restore, before the next epoch's ``set_epoch``; it calls no ``on_train_epoch_start`` for the next epoch."""
    fit_loop = trainer.fit_loop
    epoch_loop = fit_loop.epoch_loop
    return bool(fit_loop.restarted_mid_epoch and epoch_loop.restarted_on_train_batch_end
                and epoch_loop.batch_progress.is_last_batch)


def set_train_sampler_epoch(trainer: "pl.Trainer", epoch: int) -> None:
    """``set_epoch(epoch)`` on the training loaders' samplers, as ``FitLoop.on_advance_start`` does."""
    from lightning.fabric.utilities.data import _set_sampler_epoch

    loader = trainer.fit_loop._combined_loader
    for dataloader in (loader.flattened if loader is not None else []):
        _set_sampler_epoch(dataloader, epoch)


def call_before_each_unsized_fetch(trainer: "pl.Trainer", callback: Callable[[], None]) -> None:
    """Call ``callback()`` right before the fit loop fetches each training batch from a loader without a length
    (the prefetched kind). ``_TrainingEpochLoop.on_run_start`` hands ``epoch_loop._on_before_fetch`` to the data
    fetcher; it is wrapped on the instance, once per loop."""
    epoch_loop = trainer.fit_loop.epoch_loop
    before = epoch_loop._on_before_fetch
    if getattr(before, _SNAPSHOT_MARK, False):
        return

    def on_before_fetch() -> None:
        fetcher = trainer.fit_loop._data_fetcher
        if fetcher is not None and fetcher.length is None:  # only unsized loaders are prefetched
            callback()
        before()

    setattr(on_before_fetch, _SNAPSHOT_MARK, True)
    epoch_loop._on_before_fetch = on_before_fetch


def prefetched_batches(trainer: "pl.Trainer") -> int:
    """How many training batches the fit loop's fetcher holds ahead of training (``_PrefetchDataFetcher.batches``)."""
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    return len(getattr(fetcher, "batches", None) or [])


def redraw_prefetched_batch(trainer: "pl.Trainer", before_redraw: Callable[[], None]) -> None:
    """Drop the batch the fetcher prefetched, call ``before_redraw()``, and draw it again from the same iterator
    (``_PrefetchDataFetcher.batches``, ``.fetched``, ``.iterator``). Nothing happens without a prefetched batch."""
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is None or fetcher.iterator is None or not getattr(fetcher, "batches", None):
        return
    fetcher.batches.clear()
    fetcher.fetched -= 1
    before_redraw()
    fetcher.batches.append(next(fetcher.iterator))
    fetcher.fetched += 1


def train_batch_size(trainer: "pl.Trainer") -> int:
    """The training micro-batch size read from the train dataloader's source (1 if unknown).

    Replaces Lightning 2.6.6 ``DeepSpeedStrategy._auto_select_batch_size``, which reads
    ``trainer.fit_loop._data_source.dataloader().batch_sampler.batch_size`` and fails when the sampler itself
    yields batches (``DataLoader(sampler=BatchSampler(...), batch_size=None)``, as charlm does).
    """
    source = trainer.fit_loop._data_source
    if not source.is_defined():
        return 1
    loader = source.dataloader()
    for candidate in (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None), loader):
        size = getattr(candidate, "batch_size", None)
        if isinstance(size, int) and size > 0:
            return size
    return 1
