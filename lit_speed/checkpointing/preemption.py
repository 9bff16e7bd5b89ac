"""A polite stop (SIGTERM, SIGUSR1) saves the step reached, says how to resume, and exits non-zero.

Lightning already turns SIGTERM into a clean stop: its ``_SignalConnector`` notes the signal (and, on
several processes, broadcasts rank 0's flag at every batch), and the loops raise ``SIGTERMException`` at
the next batch boundary. That exception is a ``SystemExit`` with no code, so the process exits **0**
without a checkpoint. :func:`save_interrupted` runs from ``Callback.on_exception`` on that exception:
it writes ``last.ckpt`` at the step reached and gives the exception the exit code ``128 + signum``, the
code a process killed by that signal would have, so a scheduler or ``train && evaluate`` sees a failure.

SIGUSR1 (what SLURM's ``--signal`` and some schedulers send ahead of the kill) gets the same treatment
through :func:`install_stop_signal`, unless Lightning's SLURM auto-requeue handler already owns it.
"""
from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Callable

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_speed.checkpointing.resume import checkpoint_folders
from lit_speed.compat import lightning as pl_compat

log = logging.getLogger(__name__)


def request_stop(trainer: "pl.Trainer") -> None:
    """Ask the loops to stop at the next batch boundary, exactly as a SIGTERM does.

    The loops read ``trainer.received_sigterm``; setting it (a private Lightning detail, see
    :func:`lit_speed.compat.lightning.request_stop`) reuses their stop points and their cross-process broadcast.
    """
    pl_compat.request_stop(trainer)


def install_stop_signal(trainer: "pl.Trainer", signum: int, on_signal: Callable[[int], None]) -> bool:
    """Make ``signum`` stop training like SIGTERM; ``on_signal(signum)`` is called first.

    Nothing is installed off the main thread, on platforms without the signal, or when a handler is there
    already (Lightning's SLURM auto-requeue handler for SIGUSR1 saves an ``hpc`` checkpoint and requeues).
    Lightning restores the previous handlers when fit ends. Returns whether the handler was installed.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(signum)
    if current not in (None, signal.SIG_DFL):
        return False

    def handler(received: int, _: FrameType | None) -> None:
        on_signal(received)
        request_stop(trainer)

    signal.signal(signum, handler)
    return True


def last_checkpoint_path(trainer: "pl.Trainer") -> Path:
    """Where ``ckpt_path=last`` will look first: the first ``ModelCheckpoint``'s ``last.ckpt`` (or
    ``<default_root_dir>/checkpoints/last.ckpt`` without one)."""
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.dirpath is not None:
            return Path(cb.format_checkpoint_name({}, cb.CHECKPOINT_NAME_LAST))
    return Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"


def run_folder(trainer: "pl.Trainer") -> str:
    """The Hydra run folder (``hydra.run.dir``) of this job, else the Trainer's ``default_root_dir``."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return str(HydraConfig.get().runtime.output_dir)
    except (ImportError, ValueError):
        pass
    return str(trainer.default_root_dir)


def save_interrupted(trainer: "pl.Trainer", exception: BaseException, signum: int | None) -> str | None:
    """On Lightning's ``SIGTERMException``: save ``last.ckpt`` at the current step, set the exit code to
    ``128 + signum`` and return the one-line message (``None`` for any other exception).

    Args:
        trainer: The interrupted Trainer (collective on several processes: every rank gets the exception).
        exception: The exception ``on_exception`` received.
        signum: The signal that asked for the stop (``None``: SIGTERM, the only one Lightning handles).
    """
    if not isinstance(exception, SIGTERMException):
        return None
    signum = signal.SIGTERM if signum is None else signum
    path = last_checkpoint_path(trainer)
    trainer.save_checkpoint(path)
    exception.code = 128 + int(signum)
    resume = "ckpt_path=last" if path.parent in set(checkpoint_folders(trainer)) else f"ckpt_path={path}"
    return (f"interrupted at step {trainer.global_step}; resume with {resume} hydra.run.dir={run_folder(trainer)} "
            f"({signal.Signals(signum).name}; checkpoint {path})")
