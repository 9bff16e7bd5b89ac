"""One callback for what happens when things go wrong: atomic checkpoints, RNG states for exact resume,
non-finite reporting, and one clear line (with the fix) when a run dies of out-of-memory or a lost peer."""
from __future__ import annotations

import errno
import logging
import math
import shlex
import signal
from typing import Any, Sequence

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message
from typing_extensions import override

from lit_speed.checkpointing.atomic_checkpoint_io import WRITE_ERRNOS, AtomicCheckpointIO, CheckpointWriteError
from lit_speed.checkpointing.preemption import install_stop_signal, run_folder, save_interrupted
from lit_speed.checkpointing.resume import (
    checkpoint_folders,
    gather_rng_states,
    inexact_mid_epoch_resume,
    last_good_checkpoint,
    prefetched_batches,
    rebuild_next_epochs_iterator,
    recreate_train_iterator,
    redraw_prefetched_batch,
    rng_state,
    set_rng_state,
    snapshot_rng_before_each_fetch,
    train_iterator_exists,
)
from lit_speed.oom import is_oom_error

log = logging.getLogger(__name__)

NONFINITE_POLICIES = ("warn", "raise")
# ... and when a collective's peer process died or stopped answering (gloo, NCCL, the TCP store)
LOST_PEER_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe", "timed out",
                     "timeout", "nccl", "socket")


def classify_failure(exception: BaseException, world_size: int = 1) -> str | None:
    """``"out_of_memory"``, ``"lost_peer"`` (only when ``world_size > 1``) or ``None`` for anything else."""
    text = str(exception).lower()
    if is_oom_error(exception):
        return "out_of_memory"
    if world_size > 1 and isinstance(exception, (RuntimeError, ConnectionError, TimeoutError)) and any(
            m in text for m in LOST_PEER_MARKERS):
        return "lost_peer"
    return None


def out_of_memory_advice(micro_batch: int | None, overrides: Sequence[str] = (), budget_mib: float | None = None
                         ) -> str:
    """What to try after an out-of-memory, ending with the planner command that ranks what fits.

    Args:
        micro_batch: The micro-batch size that ran out of memory, if known.
        overrides: The run's command-line overrides (the planner takes the same ones).
        budget_mib: Memory per process to plan for, if known.
    """
    halve = f"data.batch_size={max(micro_batch // 2, 1)}" if micro_batch else "a smaller data.batch_size"
    plan = " ".join(["python scripts/plan.py", *(shlex.quote(o) for o in overrides)]
                    + ([f"--budget-mib {budget_mib:.0f}"] if budget_mib else []))
    return (f"Fix: {halve} with accumulation=fixed to keep the effective batch, activation checkpointing, bf16 "
            f"precision, or a ZeRO strategy with offload. To see which of these fit, run: {plan}")


def mapped_bytes() -> int | None:
    """This process's mapped address space (Linux ``VmSize``), else ``None``."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    except (OSError, StopIteration):
        return None


def memory_budget_mib(device: torch.device, mapped_at_start: int | None = None) -> float | None:
    """Memory training may use: the GPU's total; on CPU, the address-space limit (RLIMIT_AS) minus what was
    already mapped when training started, if a limit is set."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**20
    try:
        import resource
    except ImportError:  # Windows
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    return (soft - (mapped_at_start or 0)) / 2**20


def command_line_overrides() -> list[str]:
    """The overrides of the running Hydra job (``[]`` outside one)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    except (ImportError, ValueError):
        return []


def is_write_failure(exception: BaseException) -> bool:
    """A checkpoint (or any file) that could not be written for lack of space or permission."""
    return isinstance(exception, CheckpointWriteError) or (
        isinstance(exception, OSError) and exception.errno in WRITE_ERRNOS)


def write_failure_message(exception: OSError, trainer: "pl.Trainer") -> str:
    """One line: what could not be written and why, the last checkpoint that verifies, and how to go on."""
    what = str(exception) if isinstance(exception, CheckpointWriteError) else \
        f"could not write {exception.filename or 'a file'}: {exception.strerror or exception}"
    try:
        last = last_good_checkpoint(checkpoint_folders(trainer))
    except Exception as error:  # a damaged folder must not hide the original failure  # noqa: BLE001
        last = f"none usable ({error})"
    kept = f"the last checkpoint that verifies is {last}" if last else "no checkpoint was written before it"
    fix = {errno.ENOSPC: "free some space (or point hydra.run.dir at a larger disk)",
           errno.EDQUOT: "free some of your disk quota (or point hydra.run.dir elsewhere)",
           errno.EROFS: "point hydra.run.dir at a writable folder",
           }.get(exception.errno, "make the folder writable (or point hydra.run.dir at one you own)")
    return (f"Stopped at step {trainer.global_step}: {what}; {kept}, intact. Fix: {fix}, then resume with "
            f"ckpt_path=last hydra.run.dir={run_folder(trainer)}")


def nonfinite_parameters(module: torch.nn.Module) -> list[str]:
    """Names of parameters holding a NaN or an infinity (of this process's shard, under ZeRO-3)."""
    return [name for name, p in module.named_parameters() if p.numel() and not torch.isfinite(p.detach()).all()]


def loss_value(outputs: Any) -> torch.Tensor | None:
    """The loss a ``training_step`` returned (a tensor, or a dict with ``"loss"``), else ``None``."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


class FaultTolerance(Callback):
    """Make checkpoints atomic and make sure no run ends with non-finite weights without saying so.

    At ``setup`` the strategy's plain ``TorchCheckpointIO`` is replaced by :class:`AtomicCheckpointIO`
    (a user's own ``CheckpointIO`` is left alone; DeepSpeed writes its own checkpoint folders and is not
    covered). Every ``check_every_n_steps`` training batches the loss is checked; at the end of fit the
    weights are. Non-finite weights at the end are reported (``"warn"``: a warning and ``summary.json``)
    or end the run with an error (``"raise"``). What to do *during* training about an overflow is the
    precision plugin's policy (``GuardedPrecision(on_nonfinite=...)``), not this callback's.

    Args:
        atomic_checkpoints: Install :class:`AtomicCheckpointIO`.
        keep_previous: Keep the version each save replaces as ``<file>.prev`` (resume falls back to it).
        restore_rng: Save the random-number-generator states (torch, numpy, python; every rank's) with every
            checkpoint and restore them on resume, so that a run resumed from an end-of-epoch checkpoint
            shuffles and drops out exactly as the uninterrupted run. The first resumed epoch starts from the
            saved state with a training iterator built at its start (Lightning builds it earlier: before
            ``DistributedSampler.set_epoch``, and under DeepSpeed before the restore itself).
        check_every_n_steps: How often the training loss is checked (each check reads the loss on the host,
            which synchronises a GPU). ``0`` = never; the weights are still checked at the end.
        on_nonfinite_weights: ``"warn"`` or ``"raise"`` when the weights are non-finite at the end of fit.
        save_on_signal: On SIGTERM (Lightning stops at the next batch boundary) and SIGUSR1 (made to stop the
            same way unless Lightning's SLURM requeue handler owns it): save ``last.ckpt`` at the step reached,
            log "interrupted at step N; resume with ckpt_path=last hydra.run.dir=..." and exit ``128 + signum``.

    Raises:
        ValueError: On an unknown policy or a negative interval.
        RuntimeError: At the end of fit, with ``on_nonfinite_weights="raise"`` and non-finite weights.

    Example::

        trainer = Trainer(callbacks=[FaultTolerance(), ModelCheckpoint(save_last=True)])
    """

    def __init__(self, atomic_checkpoints: bool = True, keep_previous: bool = True, restore_rng: bool = True,
                 check_every_n_steps: int = 1, on_nonfinite_weights: str = "warn", save_on_signal: bool = True) -> None:
        if on_nonfinite_weights not in NONFINITE_POLICIES:
            raise ValueError(f"FaultTolerance(on_nonfinite_weights={on_nonfinite_weights!r}): on_nonfinite_weights must "
                             f"be one of {NONFINITE_POLICIES}, "
                             f"got {on_nonfinite_weights!r}. Fix: on_nonfinite_weights='warn' (report) or 'raise' (fail).")
        if not isinstance(check_every_n_steps, int) or check_every_n_steps < 0:
            raise ValueError(f"FaultTolerance(check_every_n_steps={check_every_n_steps!r}): check_every_n_steps must "
                             f"be an int >= 0 (0 = never), "
                             f"got {check_every_n_steps!r}. Fix: check_every_n_steps=1.")
        self.atomic_checkpoints = atomic_checkpoints
        self.keep_previous = keep_previous
        self.restore_rng = restore_rng
        self.check_every_n_steps = check_every_n_steps
        self.on_nonfinite_weights = on_nonfinite_weights
        self.save_on_signal = save_on_signal
        self.interrupted: str | None = None
        self._stop_signal: int | None = None
        self.checkpoint_io_name = "not set up"
        self.nonfinite_losses = 0
        self.first_nonfinite_loss_step: int | None = None
        self.nonfinite_weights: list[str] = []
        self.failure: str | None = None
        self._batch_step = 0
        self._mapped_at_setup: int | None = None
        self._trainer: pl.Trainer | None = None
        self._stale_train_iterator = False
        self._restored_rng: dict[str, Any] | None = None
        self._rng_before_fetch: dict[str, Any] | None = None  # before the newest (prefetched) batch was drawn
        self._restored_rng_before_fetch: dict[str, Any] | None = None

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._mapped_at_setup = mapped_bytes()
        self._trainer = trainer
        strategy = trainer.strategy
        # runs before Lightning restores ckpt_path, so the resume itself is verified too
        if self.atomic_checkpoints and type(strategy.checkpoint_io) is TorchCheckpointIO:
            strategy.checkpoint_io = AtomicCheckpointIO(keep_previous=self.keep_previous)
        self.checkpoint_io_name = type(strategy.checkpoint_io).__name__
        if self.restore_rng and stage == "fit":
            snapshot_rng_before_each_fetch(trainer, self._snapshot_rng)
        if isinstance(strategy, DeepSpeedStrategy):
            self.checkpoint_io_name += " (unused: DeepSpeed writes its own folders)"

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.save_on_signal and hasattr(signal, "SIGUSR1"):  # after Lightning registered its own handlers
            install_stop_signal(trainer, signal.SIGUSR1, self._note_signal)
        # Resumed mid-epoch (from a resumable loader's checkpoint): no on_train_epoch_start follows. Rebuild an
        # iterator made before the restore, then go back to the saved RNG state: the uninterrupted run went on
        # from it to the next batch, without building an iterator (whose base seed is drawn from the RNG).
        # An unsized loader (IterableDataset) had drawn one batch ahead when the checkpoint was written: draw it
        # again from the state before that fetch, then go on from the checkpoint's state.
        # Written at an epoch's last batch: Lightning goes straight on to the next epoch, whose iterator the
        # uninterrupted run built after the checkpoint (from its RNG state), not before it: exact for any loader.
        if self._restored_rng is not None and rebuild_next_epochs_iterator(trainer, self._restored_rng):
            self._restored_rng, self._stale_train_iterator, self._restored_rng_before_fetch = None, False, None
            return
        if trainer.fit_loop.restarted_mid_epoch:
            problem = inexact_mid_epoch_resume(trainer)
            if problem is not None:
                rank_zero_warn(problem)
        if self._restored_rng is not None and trainer.fit_loop.restarted_mid_epoch:
            if self._restored_rng_before_fetch is not None:
                redraw_prefetched_batch(trainer, self._restored_rng_before_fetch)
            elif self._stale_train_iterator:
                recreate_train_iterator(trainer)
            set_rng_state(self._restored_rng)
            self._restored_rng, self._stale_train_iterator, self._restored_rng_before_fetch = None, False, None

    @override
    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # The first epoch after a resume starts as the uninterrupted run's did: from the saved RNG state, with
        # an iterator built now that the sampler epoch is set. Lightning built (and prefetched) it earlier:
        # before DeepSpeed's late restore, and before DistributedSampler.set_epoch in every strategy.
        # (Only while Lightning still counts the run as resuming: after a restart at an epoch's end it builds
        # the next epoch's iterator itself, from the RNG as the uninterrupted run left it.)
        if self._restored_rng is not None:
            if trainer.fit_loop.is_resuming:
                set_rng_state(self._restored_rng)
                recreate_train_iterator(trainer)
            self._restored_rng, self._stale_train_iterator = None, False

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        self._batch_step = trainer.global_step  # by batch end, global_step already counts this batch's step

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if not self.check_every_n_steps or batch_idx % self.check_every_n_steps:
            return
        loss = loss_value(outputs)
        if loss is not None and not math.isfinite(float(loss)):
            self.nonfinite_losses += 1
            if self.first_nonfinite_loss_step is None:
                self.first_nonfinite_loss_step = self._batch_step
                rank_zero_warn(f"Non-finite training loss ({float(loss)}) at step {self._batch_step}.")

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.nonfinite_weights = nonfinite_parameters(pl_module)
        if not self.nonfinite_weights:
            return
        first = ("" if self.first_nonfinite_loss_step is None
                 else f" The first non-finite loss was at step {self.first_nonfinite_loss_step}.")
        message = (f"Training ended with non-finite weights in {len(self.nonfinite_weights)} parameter(s) "
                   f"({', '.join(self.nonfinite_weights[:3])}{', ...' if len(self.nonfinite_weights) > 3 else ''})."
                   f"{first} The model is unusable. Fix: lower the learning rate, set trainer.gradient_clip_val, "
                   "or use a precision plugin that skips non-finite steps.")
        if self.on_nonfinite_weights == "raise":
            raise RuntimeError(message)
        rank_zero_warn(message)

    def _snapshot_rng(self) -> None:
        self._rng_before_fetch = rng_state()

    def _note_signal(self, signum: int) -> None:
        self._stop_signal = signum

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        if self.save_on_signal:
            self.interrupted = save_interrupted(trainer, exception, self._stop_signal)
            if self.interrupted is not None:
                if trainer.is_global_zero:
                    log.warning(self.interrupted)
                return
        if is_write_failure(exception):
            self.failure = write_failure_message(exception, trainer)  # type: ignore[arg-type]
            log.error(rank_prefixed_message(self.failure, trainer.global_rank))
            return
        kind = classify_failure(exception, trainer.world_size)
        if kind is None:
            return
        first_line = str(exception).strip().splitlines()[0][:300] if str(exception).strip() else ""
        where = f"at step {trainer.global_step} ({type(exception).__name__}: {first_line})"
        if kind == "out_of_memory":
            self.failure = f"Out of memory {where}. " + out_of_memory_advice(
                getattr(trainer.datamodule, "batch_size", None), command_line_overrides(),
                memory_budget_mib(pl_module.device, self._mapped_at_setup))
        else:
            try:
                last = last_good_checkpoint(checkpoint_folders(trainer))
            except Exception as error:  # a damaged checkpoint folder must not hide the original failure
                last = f"none usable ({error})"
            self.failure = (f"Lost contact with another process of this run {where}: a process died or stopped "
                            f"answering. Last checkpoint that verifies: {last}. Fix: find the failed process in the "
                            "logs, then resume with ckpt_path=last and the same run folder (hydra.run.dir=...).")
        log.error(rank_prefixed_message(self.failure, trainer.global_rank))

    def describe(self) -> dict[str, str]:
        """Rows for the start-up table."""
        io = ("atomic, CRC-verified" + (", previous kept as .prev" if self.keep_previous else "")
              if self.atomic_checkpoints else "Lightning default")
        return {"fault tolerance": f"checkpoints {io}; RNG {'saved' if self.restore_rng else 'not saved'}; "
                                   f"non-finite weights at the end: {self.on_nonfinite_weights}"}

    def final_summary(self) -> dict[str, Any]:
        """End-of-run facts for ``summary.json``."""
        return {"checkpoint_io": self.checkpoint_io_name, "nonfinite_losses": self.nonfinite_losses,
                "first_nonfinite_loss_step": self.first_nonfinite_loss_step,
                "nonfinite_weights": self.nonfinite_weights, "weights_finite": not self.nonfinite_weights,
                "failure": self.failure, "interrupted": self.interrupted}

    @override
    def state_dict(self) -> dict[str, Any]:
        state = {"nonfinite_losses": self.nonfinite_losses, "first_nonfinite_loss_step": self.first_nonfinite_loss_step}
        if self._trainer is not None:  # rows each resumable logger holds now: a resume keeps exactly these
            state["logger_rows"] = [logger.rows_logged() if hasattr(logger, "rows_logged") else None
                                    for logger in self._trainer.loggers]
        if self.restore_rng:
            state["rng"] = rng_state()
            # Lightning writes rank 0's callback states only; the other ranks' RNG streams differ
            per_rank = gather_rng_states()
            if per_rank is not None:
                state["rng_per_rank"] = per_rank
            elif self._trainer is not None and prefetched_batches(self._trainer) and self._rng_before_fetch is not None:
                state["rng_before_prefetch"] = self._rng_before_fetch
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.nonfinite_losses = state_dict.get("nonfinite_losses", 0)
        self.first_nonfinite_loss_step = state_dict.get("first_nonfinite_loss_step")
        if self._trainer is not None:  # the rows the loggers held when this checkpoint was written come back
            for logger, rows in zip(self._trainer.loggers, state_dict.get("logger_rows") or []):
                if rows is not None and hasattr(logger, "restore_rows"):
                    logger.restore_rows(rows)
        if not self.restore_rng or state_dict.get("rng") is None:
            return
        state = state_dict["rng"]
        per_rank = state_dict.get("rng_per_rank")
        trainer = self._trainer
        world_size, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        if per_rank is not None and len(per_rank) == world_size:
            state = per_rank[rank]
        elif world_size > 1 or per_rank is not None:
            rank_zero_warn(f"The checkpoint holds RNG states for {len(per_rank) if per_rank else 1} process(es), "
                           f"this run has {world_size}: every process gets rank 0's, so the resumed run shuffles "
                           "and drops out differently from an uninterrupted one.")
        set_rng_state(state)
        self._restored_rng = state
        self._restored_rng_before_fetch = state_dict.get("rng_before_prefetch") if world_size == 1 else None
        # Most strategies restore callbacks before configure_optimizers, so the training iterator is made
        # after this point. DeepSpeed restores after its setup: the iterator configure_optimizers may have
        # made (estimated_stepping_batches) has shuffled with the fresh seed and the wrong sampler epoch.
        self._stale_train_iterator = train_iterator_exists(trainer)
