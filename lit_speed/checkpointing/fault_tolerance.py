"""One callback for what happens when things go wrong: atomic checkpoints, RNG states for exact resume,
non-finite reporting, and one clear line (with the fix) when a run dies of out-of-memory or a lost peer."""
from __future__ import annotations

import logging
import math
import signal
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message
from typing_extensions import override

from lit_speed.checkpointing.atomic_checkpoint_io import AtomicCheckpointIO
from lit_speed.checkpointing.failures import (  # noqa: F401 - re-exported: the names were defined here before
    LOST_PEER_MARKERS,
    NONFINITE_POLICIES,
    classify_failure,
    command_line_overrides,
    is_write_failure,
    loss_value,
    mapped_bytes,
    memory_budget_mib,
    nonfinite_parameters,
    out_of_memory_advice,
    write_failure_message,
)
from lit_speed.checkpointing.preemption import save_interrupted
from lit_speed.checkpointing.resume import (
    checkpoint_folders,
    gather_per_rank,
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
from lit_speed.checkpointing.run_state import (
    at_epoch_end,
    load_metric_states,
    metric_states,
    pending_log_row,
    write_log_row,
)
from lit_speed.checkpointing.signal_stop import SignalStop
from lit_speed.checkpointing.signal_wakeup import watch_stop_signals
from lit_speed.checkpointing.stop_signals import INBOX, record_signal_if_unhandled
from lit_speed.compat.lightning_loops import resume_finished_epoch_as_new_epoch, uncount_batch_if_validation_skipped

log = logging.getLogger(__name__)

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
        save_on_signal: On SIGTERM and SIGUSR1 (unless Lightning's SLURM requeue handler owns it) in any process
            of the run: every process stops after the same training batch, ``last.ckpt`` is saved there, rank 0
            logs "interrupted at step N; resume with ckpt_path=last hydra.run.dir=..." and each process exits
            ``128 + signum`` (:mod:`lit_speed.checkpointing.signal_stop`; the signal handler itself only records).
        signal_deadline_s: With ``save_on_signal``: seconds from the signal to the exit. When the running batch
            would end later (a long step, a long validation), a watchdog thread saves the state after the last
            completed optimizer step instead and the process exits within about this time (the measured save
            time is kept in hand). ``None``: wait for the running batch, however long. Costs one in-memory
            snapshot of the non-weight state per optimizer step (weights and optimizer state are not copied).

    Raises:
        ValueError: On an unknown policy, a negative interval or a deadline that is not a positive number.
        RuntimeError: At the end of fit, with ``on_nonfinite_weights="raise"`` and non-finite weights.

    Example::

        trainer = Trainer(callbacks=[FaultTolerance(), ModelCheckpoint(save_last=True)])
    """

    def __init__(self, atomic_checkpoints: bool = True, keep_previous: bool = True, restore_rng: bool = True,
                 check_every_n_steps: int = 1, on_nonfinite_weights: str = "warn", save_on_signal: bool = True,
                 signal_deadline_s: float | None = None) -> None:
        if on_nonfinite_weights not in NONFINITE_POLICIES:
            raise ValueError(f"FaultTolerance(on_nonfinite_weights={on_nonfinite_weights!r}): on_nonfinite_weights must "
                             f"be one of {NONFINITE_POLICIES}, "
                             f"got {on_nonfinite_weights!r}. Fix: on_nonfinite_weights='warn' (report) or 'raise' (fail).")
        if not isinstance(check_every_n_steps, int) or check_every_n_steps < 0:
            raise ValueError(f"FaultTolerance(check_every_n_steps={check_every_n_steps!r}): check_every_n_steps must "
                             f"be an int >= 0 (0 = never), "
                             f"got {check_every_n_steps!r}. Fix: check_every_n_steps=1.")
        if signal_deadline_s is not None and (isinstance(signal_deadline_s, bool)
                                              or not isinstance(signal_deadline_s, (int, float))
                                              or not math.isfinite(signal_deadline_s) or signal_deadline_s <= 0):
            raise ValueError(f"FaultTolerance(signal_deadline_s={signal_deadline_s!r}): signal_deadline_s must be a "
                             f"number of seconds > 0, or None to wait for the running step, got {signal_deadline_s!r}. "
                             "Fix: signal_deadline_s=25 (below your scheduler's grace period: Kubernetes and SLURM "
                             "allow 30 s by default).")
        self.atomic_checkpoints = atomic_checkpoints
        self.keep_previous = keep_previous
        self.restore_rng = restore_rng
        self.check_every_n_steps = check_every_n_steps
        self.on_nonfinite_weights = on_nonfinite_weights
        self.save_on_signal = save_on_signal
        self.signal_deadline_s = None if signal_deadline_s is None else float(signal_deadline_s)
        self.interrupted: str | None = None
        self._signals: SignalStop | None = None
        self._pending_row: tuple[dict[str, Any], list[Any]] | None = None  # (row, loggers): after restored rows
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
        self._restored_after_batch_end = False  # the checkpoint was written after its batch's step was counted

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
        if stage == "fit":  # with max_steps, Lightning 2.6.6 retrains a batch after an end-of-epoch checkpoint
            resume_finished_epoch_as_new_epoch(trainer)
        if self.save_on_signal and stage == "fit":  # before fit registers its signal handlers
            self._signals = SignalStop(trainer, self.signal_deadline_s, self.state_key)
        if isinstance(strategy, DeepSpeedStrategy):
            self.checkpoint_io_name += " (unused: DeepSpeed writes its own folders)"

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.save_on_signal:  # after Lightning registered its own handlers
            usr1 = hasattr(signal, "SIGUSR1") and record_signal_if_unhandled(signal.SIGUSR1)
            # seen when it arrives, even while the main thread is in a long backward (a Python handler waits for it)
            watch_stop_signals([signal.SIGTERM, *([signal.SIGUSR1] if usr1 else [])])
        if self._signals is not None:
            self._signals.on_train_start()
        if self._restored_after_batch_end:
            uncount_batch_if_validation_skipped(trainer)
            self._restored_after_batch_end = False
        if self._pending_row is not None:  # after the restored rows, before this run logs anything
            write_log_row(*self._pending_row)
            self._pending_row = None
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
        if self._signals is not None:
            self._signals.after_batch_end = False

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

    @override
    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Any) -> None:
        if self._signals is not None:
            self._signals.before_update()

    @override
    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._signals is not None and trainer.state.fn == "fit":
            self._signals.before_validation()

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if self._signals is not None:
            self._signals.end()

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        if self.save_on_signal:
            signals = self._signals
            if signals is not None:
                signals.begin_polite_save()  # waits for good if a deadline watchdog owns the state already
            self.interrupted = save_interrupted(trainer, exception, signals.signum if signals else INBOX.signum)
            if signals is not None:
                signals.end()
            if self.interrupted is not None:
                INBOX.clear()  # honoured: a later fit in this process starts clean
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
        state: dict[str, Any] = {"nonfinite_losses": self.nonfinite_losses,
                                 "first_nonfinite_loss_step": self.first_nonfinite_loss_step}
        if self._signals is not None and self._signals.after_batch_end:  # a stop's save, after the loggers' count
            state["after_batch_end"] = True
        trainer = self._trainer
        # a snapshot for the signal deadline is read on rank 0 alone: no collective, no file I/O
        capturing = self._signals is not None and self._signals.capturing
        if trainer is not None:  # rows each resumable logger holds now: a resume keeps exactly these
            state["logger_rows"] = [(logger.rows_held() if capturing else logger.rows_logged())
                                    if hasattr(logger, "rows_logged") else None for logger in trainer.loggers]
            row = None if capturing else pending_log_row(trainer)
            if row is not None:  # Lightning writes it right after this hook: after the checkpoint
                state["pending_log_row"] = row
        # what the metrics accumulated in this epoch (not at its end: Lightning resets the logged ones right after)
        metrics = metric_states(trainer.lightning_module) if trainer is not None and not at_epoch_end(trainer) else {}
        rng = rng_state() if self.restore_rng else None
        # Lightning writes rank 0's callback states only; the other ranks' RNG streams and metric states differ
        per_rank = None if capturing else gather_per_rank({"rng": rng, "metrics": metrics})
        if per_rank is not None:
            state["metrics_per_rank"] = [part["metrics"] for part in per_rank]
        else:
            state["metrics"] = metrics
        if self.restore_rng:
            state["rng"] = rng
            if per_rank is not None:
                state["rng_per_rank"] = [part["rng"] for part in per_rank]
            elif trainer is not None and prefetched_batches(trainer) and self._rng_before_fetch is not None:
                state["rng_before_prefetch"] = self._rng_before_fetch
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.nonfinite_losses = state_dict.get("nonfinite_losses", 0)
        self.first_nonfinite_loss_step = state_dict.get("first_nonfinite_loss_step")
        self._restored_after_batch_end = bool(state_dict.get("after_batch_end"))
        trainer = self._trainer
        world_size, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        if trainer is not None:  # the rows the loggers held when this checkpoint was written come back
            restored = [logger for logger, rows in zip(trainer.loggers, state_dict.get("logger_rows") or [])
                        if rows is not None and hasattr(logger, "restore_rows") and logger.restore_rows(rows) is not None]
            if restored and state_dict.get("pending_log_row") is not None:
                self._pending_row = (state_dict["pending_log_row"], restored)
            per_rank = state_dict.get("metrics_per_rank")
            metrics = (per_rank[rank] if per_rank is not None and len(per_rank) == world_size
                       else state_dict.get("metrics") if world_size == 1 and per_rank is None else None)
            if metrics:
                load_metric_states(trainer.lightning_module, metrics)
        if not self.restore_rng or state_dict.get("rng") is None:
            return
        state = state_dict["rng"]
        per_rank = state_dict.get("rng_per_rank")
        if per_rank is not None and len(per_rank) == world_size:
            state = per_rank[rank]
        elif world_size > 1 or per_rank is not None:
            rank_zero_warn(f"The checkpoint holds RNG states for {len(per_rank) if per_rank else 1} process(es), "
                           f"this run has {world_size}: every process gets rank 0's, so the resumed run shuffles "
                           "and drops out differently from an uninterrupted one (and its metrics restart the epoch).")
        set_rng_state(state)
        self._restored_rng = state
        self._restored_rng_before_fetch = state_dict.get("rng_before_prefetch") if world_size == 1 else None
        # Most strategies restore callbacks before configure_optimizers, so the training iterator is made
        # after this point. DeepSpeed restores after its setup: the iterator configure_optimizers may have
        # made (estimated_stepping_batches) has shuffled with the fresh seed and the wrong sampler epoch.
        self._stale_train_iterator = train_iterator_exists(trainer)
