"""Resolve ``ckpt_path=last`` to the newest checkpoint that verifies, skipping damaged ones with a warning.

Lightning's own ``ckpt_path="last"`` picks the newest ``last*.ckpt`` by modification time and loads it
as is: a truncated or bit-rotted file ends the resume with a zip error, and a damaged file that still
parses is loaded silently. :func:`resolve_ckpt_path` is run before ``trainer.fit`` instead.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable, Iterable

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn

from lit_speed.checkpointing.atomic_checkpoint_io import PREVIOUS_SUFFIX, CorruptCheckpointError, verify_checkpoint
from lit_speed.compat import lightning_data

LIGHTNING_KEYWORDS = ("best", "hpc", "registry")  # ckpt_path values Lightning resolves itself


def checkpoint_candidates(folders: Iterable[str | Path]) -> list[Path]:
    """Every checkpoint in ``folders`` (``*.ckpt``, their ``.prev`` versions, DeepSpeed folders), newest first.

    Newest means latest modification time, as in Lightning; a ``.prev`` hard link keeps the time of the
    save that wrote it, so it sorts after the file that replaced it.
    """
    found: set[Path] = set()
    for folder in folders:
        folder = Path(folder)
        if folder.is_dir():
            found.update(p for p in folder.iterdir()
                         if p.name.endswith(".ckpt") or p.name.endswith(".ckpt" + PREVIOUS_SUFFIX))
    return sorted(found, key=lambda p: (_modified_ns(p), p.name.startswith("last")), reverse=True)


def _modified_ns(path: Path) -> int:
    """Modification time; for a folder (DeepSpeed) the newest file inside it, since a folder's own time
    does not change when a file in a subfolder is overwritten."""
    if path.is_dir():
        return max((p.stat().st_mtime_ns for p in path.rglob("*") if p.is_file()), default=path.stat().st_mtime_ns)
    return path.stat().st_mtime_ns


def last_good_checkpoint(folders: Iterable[str | Path]) -> Path | None:
    """The newest checkpoint in ``folders`` that passes :func:`verify_checkpoint`; ``None`` if there is none.

    Args:
        folders: Checkpoint folders (the ``dirpath`` of each ``ModelCheckpoint``).

    Raises:
        CorruptCheckpointError: If checkpoints exist but every one of them is damaged.

    Example::

        ckpt = last_good_checkpoint(["logs/train/runs/x/checkpoints"])
    """
    candidates = checkpoint_candidates(folders)
    problems = []
    for path in candidates:
        try:
            verify_checkpoint(path)
        except CorruptCheckpointError as error:
            problems.append(str(error))
            moved = move_aside(path) if path.is_dir() else None
            rank_zero_warn(f"{error} Trying the next older checkpoint."
                           + (f" The damaged folder was moved to {moved.name}, so that the next save writes "
                              f"{path.name} again." if moved is not None else ""))
            continue
        if problems:
            rank_zero_warn(f"Resuming from {path}, the newest checkpoint that verifies ({len(problems)} newer "
                           "damaged file(s) skipped).")
        return path
    if problems:
        raise CorruptCheckpointError(
            f"ckpt_path=last: all {len(problems)} checkpoint(s) are damaged, so there is nothing to resume from. "
            f"Fix: start from scratch with ckpt_path=null, or pass ckpt_path=<a good checkpoint>. First: {problems[0]}")
    return None


def move_aside(path: Path) -> Path | None:
    """Rename a damaged checkpoint folder to ``<name>.damaged-<n>`` (on global rank 0 only; ``None`` elsewhere).

    DeepSpeed writes its checkpoint folders file by file, not atomically: a process killed inside a save
    leaves e.g. a truncated ``last.ckpt/.../optim_states.pt``. Left in place, it makes ``ModelCheckpoint``
    write the next last checkpoint as ``last-v1.ckpt`` and stays the newest folder by name; moved aside,
    ``last.ckpt`` again names the newest good checkpoint after the next save. Nothing is deleted.
    """
    if rank_zero_only.rank != 0:
        return None
    n = 0
    while (target := path.with_name(f"{path.name}.damaged-{n}")).exists():
        n += 1
    path.rename(target)
    return target


def checkpoint_folders(trainer: "pl.Trainer") -> list[Path]:
    """The folders the Trainer's ``ModelCheckpoint`` callbacks write to (their ``dirpath``); without any, the
    ``<default_root_dir>/checkpoints`` folder where a stop on a signal saves ``last.ckpt``."""
    folders = [Path(cb.dirpath) for cb in trainer.checkpoint_callbacks
               if isinstance(cb, ModelCheckpoint) and cb.dirpath is not None]
    return folders or [Path(trainer.default_root_dir) / "checkpoints"]


def resolve_ckpt_path(ckpt_path: str | Path | None, trainer: "pl.Trainer") -> str | Path | None:
    """What to pass to ``trainer.fit(ckpt_path=...)``.

    ``"last"`` becomes the newest checkpoint that verifies in the Trainer's checkpoint folders (``None``,
    a fresh start, when there is none yet); an explicit file is verified; ``None`` and Lightning's other
    keywords (``"best"``, ``"hpc"``, ``"registry"``) pass through.

    Args:
        ckpt_path: The configured ``ckpt_path``.
        trainer: The Trainer about to fit; its ``ModelCheckpoint`` folders are searched.

    Raises:
        CorruptCheckpointError: If an explicit checkpoint, or every checkpoint for ``"last"``, is damaged.

    Example::

        trainer.fit(model, datamodule=dm, ckpt_path=resolve_ckpt_path("last", trainer))
    """
    if ckpt_path is None or ckpt_path in LIGHTNING_KEYWORDS or "://" in str(ckpt_path):
        return ckpt_path
    if ckpt_path == "last":
        path = last_good_checkpoint(checkpoint_folders(trainer))
        if path is None:
            rank_zero_info("ckpt_path=last: no checkpoint yet in this run folder; starting from scratch.")
        return None if path is None else str(path)
    if not Path(ckpt_path).exists():
        raise FileNotFoundError(f"ckpt_path={ckpt_path}: no such file. Fix: pass an existing checkpoint, "
                                "ckpt_path=last to resume this run folder, or ckpt_path=null to start fresh.")
    verify_checkpoint(ckpt_path)
    return ckpt_path


def rng_state() -> dict[str, Any]:
    """This process's random-number-generator states, in types ``torch.load(weights_only=True)`` accepts.

    Lightning does not checkpoint them: without them a resumed run reshuffles its next epoch and draws
    different dropout masks from the uninterrupted run, so resuming cannot be exact.
    """
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def gather_per_rank(part: Any) -> list[Any] | None:
    """Every process's ``part``, in rank order, when ``torch.distributed`` runs several; else ``None``.

    A collective: called while Lightning dumps a checkpoint, which it does on every process.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, part)
    return parts


def gather_rng_states() -> list[dict[str, Any]] | None:
    """Every process's :func:`rng_state`, in rank order, when ``torch.distributed`` runs several; else ``None``."""
    return gather_per_rank(rng_state())


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured (keys missing from older checkpoints are left alone)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def train_iterator_exists(trainer: "pl.Trainer | None") -> bool:
    """Whether the fit loop already holds a training-data iterator (private fit-loop detail, Lightning 2.6.6).

    ``trainer.estimated_stepping_batches`` (read in ``configure_optimizers`` by every schedule that needs
    the total step count) runs ``fit_loop.setup_data()``, which creates the iterator - and, with
    Lightning's prefetching fetcher, draws the first batch - at once. Strategies that restore a
    checkpoint after their setup (``restore_checkpoint_after_setup``, e.g. DeepSpeed) therefore build the
    first resumed epoch's iterator *before* the RNG states and the sampler epoch are restored
    (Lightning issue #20550 is the same ordering bug for stateful loaders).
    """
    return lightning_data.train_iterator_exists(trainer)


def recreate_train_iterator(trainer: "pl.Trainer") -> None:
    """Build the fit loop's training iterator again, as Lightning does itself at the start of every epoch
    after the first (``_TrainingEpochLoop.on_run_start`` calls ``iter(data_fetcher)``): samplers shuffle
    and the loader draws its base seed from the RNG states as they are now; a prefetched batch is dropped."""
    lightning_data.recreate_train_iterator(trainer)


def rebuild_next_epochs_iterator(trainer: "pl.Trainer", state: dict[str, Any]) -> bool:
    """Resumed from a checkpoint written at an epoch's last training batch: build the next epoch's iterator as
    the uninterrupted run did, after its ``set_epoch`` and from the RNG ``state`` of the checkpoint (Lightning
    built one right after the restore, for the old sampler epoch). Returns whether this was that case."""
    if not lightning_data.restarted_after_an_epochs_last_batch(trainer):
        return False
    lightning_data.set_train_sampler_epoch(trainer, trainer.fit_loop.epoch_progress.current.processed)
    set_rng_state(state)
    lightning_data.recreate_train_iterator(trainer)
    return True


def snapshot_rng_before_each_fetch(trainer: "pl.Trainer", snapshot: Callable[[], None]) -> None:
    """Call ``snapshot()`` right before the fit loop fetches each training batch (private fit-loop detail,
    Lightning 2.6.6: ``_TrainingEpochLoop.on_run_start`` hands its ``_on_before_fetch`` to the data fetcher).

    A loader without a length (an ``IterableDataset``) is prefetched one batch ahead: when a checkpoint is
    written after batch k, batch k+1 has already been drawn from the global RNGs. Resuming from the RNG state
    at the checkpoint alone therefore skips or repeats one batch; the state before that fetch replays it.
    """
    lightning_data.call_before_each_unsized_fetch(trainer, snapshot)


def prefetched_batches(trainer: "pl.Trainer") -> int:
    """How many training batches the fit loop's fetcher holds ahead of training (private, Lightning 2.6.6)."""
    return lightning_data.prefetched_batches(trainer)


def inexact_mid_epoch_resume(trainer: "pl.Trainer") -> str | None:
    """Why resuming this run's training loader mid-epoch cannot be exact, with the fix; ``None`` when it can.

    Exact: a loader or sampler with ``load_state_dict`` (the built-in DataModules, ``StatefulDataLoader``), and
    an ``IterableDataset`` read in the main process that draws from the global RNGs (FaultTolerance restores
    them). Not exact: an ``IterableDataset`` in worker processes (the workers' RNG streams are not in any
    checkpoint), and a map-style dataset whose sampler restarts its epoch (``shuffle=True`` draws a new one).
    """
    from torch.utils.data import DataLoader, IterableDataset

    loader = trainer.train_dataloader
    loaders = loader if isinstance(loader, (list, tuple)) else list(loader.values()) if isinstance(loader, dict) else [loader]
    for dl in loaders:
        if not isinstance(dl, DataLoader) or hasattr(dl, "load_state_dict"):
            continue
        name = type(dl.dataset).__name__
        if isinstance(dl.dataset, IterableDataset):
            if dl.num_workers > 0 and not hasattr(dl.dataset, "load_state_dict"):
                return (f"mid-epoch resume is not exact: {name} is an IterableDataset read in {dl.num_workers} worker "
                        "process(es), whose RNG streams no checkpoint holds. Fix: num_workers=0 (then FaultTolerance "
                        "replays it exactly), state_dict/load_state_dict on the dataset, or end-of-epoch checkpoints.")
            continue
        sampler = dl.batch_sampler if dl.batch_sampler is not None else dl.sampler
        inner = getattr(sampler, "sampler", sampler)
        if not (hasattr(sampler, "load_state_dict") or hasattr(inner, "load_state_dict")):
            return (f"mid-epoch resume is not exact: the loader of {name} restarts its epoch with "
                    f"{type(inner).__name__} (new shuffle, repeated batches). Fix: a sampler with state_dict/"
                    "load_state_dict (e.g. lit_speed.data.resumable.ResumableShuffleSampler), torchdata's "
                    "StatefulDataLoader, or checkpoints at epoch ends.")
    return None


def redraw_prefetched_batch(trainer: "pl.Trainer", state: dict[str, Any]) -> None:
    """Drop the batch the fit loop's fetcher prefetched and draw it again after restoring ``state`` (private
    fetcher detail, Lightning 2.6.6: ``_PrefetchDataFetcher.batches``). The iterator itself is kept: building
    a new one would draw a base seed from the torch RNG between ``state`` and the fetch."""
    lightning_data.redraw_prefetched_batch(trainer, lambda: set_rng_state(state))
