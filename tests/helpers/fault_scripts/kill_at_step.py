"""A callback that SIGKILLs its own process at a chosen optimizer step: a preemption with no warning.

Used by tests/checkpointing/test_faults_resume.py through a Hydra override (the child gets the checkout's root on
PYTHONPATH): ``+callbacks.kill._target_=tests.helpers.fault_scripts.kill_at_step.KillAtStep +callbacks.kill.step=37``.
"""
from __future__ import annotations

import errno
import io
import os
import signal
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

import lit_speed.checkpointing.atomic_checkpoint_io as atomic_io
from lit_speed.checkpointing.stop_signals import INBOX


def _truncate_and_kill_in_last_optim_save(save: Any) -> Any:
    """``torch.save`` that, for ``last.ckpt/**/*optim_states.pt``, writes half the bytes and SIGKILLs."""

    def patched(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        name = str(f)
        if "last.ckpt" in name and name.endswith("optim_states.pt"):
            buffer = io.BytesIO()
            save(obj, buffer, *args, **kwargs)
            with open(name, "wb") as out:
                out.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        return save(obj, f, *args, **kwargs)

    return patched


class _KillBeforeRename:
    """Stands in for the ``os`` module inside atomic_checkpoint_io: every call passes through, except that
    the rename of a finished temporary checkpoint over its destination kills the process instead."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    @staticmethod
    def replace(src: Any, dst: Any) -> None:
        if ".tmp-" in str(src):
            os.kill(os.getpid(), signal.SIGKILL)
        os.replace(src, dst)


class _DiskFull:
    """Stands in for the ``os`` module inside atomic_checkpoint_io: every call passes through, except that flushing
    a temporary checkpoint to disk fails as on a full disk (after its bytes were partly written)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    @staticmethod
    def fsync(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


MODES = ("step", "before_rename", "sigterm", "sigusr1", "in_zero_last_save", "disk_full")
SIGNALS = {"sigterm": signal.SIGTERM, "sigusr1": getattr(signal, "SIGUSR1", None)}


class KillAtStep(Callback):
    """SIGKILL this process once ``trainer.global_step`` reaches ``step`` (on rank ``rank`` only).

    Args:
        step: Optimizer step after which to die.
        batch: Die after this many training batches of this process instead (counts the micro-batches inside an
            accumulation window, so a signal can land mid-window).
        rank: Global rank that dies (the others are left to notice); ``-1``: every rank (a signal to the
            whole process group, as SLURM and ``kill -TERM -<pgid>`` send it).
        mode: ``"step"`` kills right after the batch; ``"before_rename"`` kills inside the next checkpoint
            save, after the temporary file is written and before it replaces the old checkpoint; ``"sigterm"``
            and ``"sigusr1"`` send that signal instead of SIGKILL (a scheduler's polite stop), once;
            ``"in_zero_last_save"`` kills inside the next DeepSpeed save of ``last.ckpt/``, leaving its
            ``optim_states.pt`` truncated (DeepSpeed writes its folders file by file); ``"disk_full"`` makes every
            later checkpoint write fail with ENOSPC (no space left on device).
    """

    def __init__(self, step: int = -1, rank: int = 0, mode: str = "step", batch: int | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.step, self.rank, self.mode, self.batch = step, rank, mode, batch
        self._batches = 0  # training batches ended in this process (micro-batches: inside accumulation windows too)
        self._fired = False

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        self._batches += 1
        reached = self._batches >= self.batch if self.batch is not None else trainer.global_step >= self.step
        if self.rank not in (-1, trainer.global_rank) or not reached:
            return
        if self.mode == "step":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.mode in SIGNALS:
            if not self._fired:  # once: the run stops at the end of this batch
                self._fired = True
                os.kill(os.getpid(), SIGNALS[self.mode])
            return
        if self.mode == "disk_full":  # from this step on, every checkpoint write finds the disk full
            atomic_io.os = _DiskFull()
            return
        if self.mode == "in_zero_last_save":
            torch.save = _truncate_and_kill_in_last_optim_save(torch.save)
            return
        atomic_io.os = _KillBeforeRename()


class NoteSignalAt(Callback):
    """In-process stand-in for a signal: record a SIGTERM in the inbox, as the handler does, at the end of a chosen
    optimizer step (no real signal reaches the test process)."""

    def __init__(self, step: int) -> None:
        self.step = step

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", *args: Any) -> None:
        if trainer.global_step == self.step:
            INBOX.note(signal.SIGTERM)
