"""A polite stop (SIGTERM, SIGUSR1) saves the step reached, says how to resume, and exits non-zero.

Lightning turns SIGTERM into ``SIGTERMException`` at a batch boundary: a ``SystemExit`` with no code, so the
process exits **0** without a checkpoint. :class:`~lit_speed.checkpointing.FaultTolerance` records the signal
instead (:mod:`lit_speed.checkpointing.stop_signals`), has every process agree to stop after the same batch
(:mod:`lit_speed.checkpointing.signal_stop`) and, from ``Callback.on_exception``, runs :func:`save_interrupted`:
``last.ckpt`` at the step reached and the exit code ``128 + signum``, the code a process killed by that signal would
have, so a scheduler or ``train && evaluate`` sees a failure.
"""
from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_speed.checkpointing.resume import checkpoint_folders
from lit_speed.compat import lightning as pl_compat

log = logging.getLogger(__name__)


def request_stop(trainer: "pl.Trainer") -> None:
    """Ask the loops to stop at the next batch boundary, exactly as a SIGTERM does in one process.

    The loops read ``trainer.received_sigterm``; setting it (a private Lightning detail, see
    :func:`lit_speed.compat.lightning.request_stop`) reuses their stop points. On several processes set it in all
    of them at the same point (FaultTolerance decides a signal's stop so), or they stop at different batches.
    """
    pl_compat.request_stop(trainer)


def last_checkpoint_path(trainer: "pl.Trainer") -> Path:
    """Where ``ckpt_path=last`` will look first: the first ``ModelCheckpoint``'s ``last.ckpt`` (or
    ``<default_root_dir>/checkpoints/last.ckpt`` without one)."""
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.dirpath is not None:
            return Path(cb.format_checkpoint_name({}, cb.CHECKPOINT_NAME_LAST))
    return Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"


def claim_last(trainer: "pl.Trainer", path: Path, checkpoint: dict[str, Any] | None = None) -> None:
    """Record ``path`` as the ``last.ckpt`` that each ``ModelCheckpoint`` writing there wrote itself (in the callback
    and, given ``checkpoint``, in the state saved with it).

    A stop saves ``last.ckpt`` outside ``ModelCheckpoint``. Before its first own save, the callback's
    ``last_model_path`` is empty, so a resumed run found a ``last.ckpt`` it did not know, wrote ``last-v1.ckpt`` from
    then on and left ``last.ckpt`` at the stop's step (measured: SIGTERM at step 3 of 40, resumed to step 40, and
    ``ckpt_path=last`` still named step 3).
    """
    for cb in trainer.checkpoint_callbacks:
        if not isinstance(cb, ModelCheckpoint) or cb.dirpath is None:
            continue
        name = cb.format_checkpoint_name({}, cb.CHECKPOINT_NAME_LAST)
        if Path(name) != Path(path):
            continue
        cb.last_model_path = name
        states = (checkpoint or {}).get("callbacks") or {}
        if isinstance(states.get(cb.state_key), dict):
            states[cb.state_key] = {**states[cb.state_key], "last_model_path": name}


def run_folder(trainer: "pl.Trainer") -> str:
    """The Hydra run folder (``hydra.run.dir``) of this job, else the Trainer's ``default_root_dir``."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return str(HydraConfig.get().runtime.output_dir)
    except (ImportError, ValueError):
        pass
    return str(trainer.default_root_dir)


def resume_hint(trainer: "pl.Trainer", path: Path) -> str:
    """``ckpt_path=last`` when ``path`` is where it looks, else ``ckpt_path=<path>``."""
    return "ckpt_path=last" if path.parent in set(checkpoint_folders(trainer)) else f"ckpt_path={path}"


def save_interrupted(trainer: "pl.Trainer", exception: BaseException, signum: int | None) -> str | None:
    """On Lightning's ``SIGTERMException``: save ``last.ckpt`` at the current step, set the exit code to
    ``128 + signum`` and return the one-line message (``None`` for any other exception).

    Args:
        trainer: The interrupted Trainer (collective on several processes: every rank gets the exception).
        exception: The exception ``on_exception`` received.
        signum: The signal that asked for the stop (``None``: SIGTERM).
    """
    if not isinstance(exception, SIGTERMException):
        return None
    signum = signal.SIGTERM if signum is None else signum
    path = last_checkpoint_path(trainer)
    claim_last(trainer, path)
    trainer.save_checkpoint(path, weights_only=False)  # the whole training state a resume needs (optimizer, loops)
    exception.code = 128 + int(signum)
    return (f"interrupted at step {trainer.global_step}; resume with {resume_hint(trainer, path)} hydra.run.dir="
            f"{run_folder(trainer)} ({signal.Signals(signum).name}; step {trainer.global_step} saved with its "
            f"optimizer and loop state; checkpoint {path})")
