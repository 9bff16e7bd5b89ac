"""How :class:`~lit_speed.checkpointing.FaultTolerance` handles stop signals: one decision after each training batch,
taken by every process together, and (with a deadline) a watchdog that saves the last completed step instead of
waiting for a step that would end too late.

Guarantees (tests in ``tests/checkpointing/test_faults_signals*.py``): a SIGTERM or SIGUSR1 to any process of a run
(Lightning's launcher, ``torchrun``, the ``deepspeed`` launcher) makes every process stop after the same batch,
save one checkpoint, print how to resume and exit ``128 + signum``; with ``signal_deadline_s`` they do so within
that time even when a step is longer, saving the state after the last completed optimizer step.
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_speed.checkpointing.preemption import claim_last, last_checkpoint_path, resume_hint, run_folder
from lit_speed.checkpointing.resume import checkpoint_folders, last_good_checkpoint
from lit_speed.checkpointing.run_state import rank_part
from lit_speed.checkpointing.signal_deadline import DeadlineWatchdog, PeerChannel
from lit_speed.checkpointing.stop_signals import (
    INBOX,
    Snapshot,
    StepGate,
    keep_live_copy_rest,
    signal_name,
    storage_ids,
)
from lit_speed.compat import deepspeed as ds_compat
from lit_speed.compat import lightning as pl_compat
from lit_speed.compat import lightning_loops as loops
from lit_speed.interfaces import PartwiseCheckpointWriter

log = logging.getLogger(__name__)

SAVE_BYTES_PER_S = 100e6  # a conservative write speed for the first save's estimate (before one was timed)


def optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """The parameters and state tensors of ``optimizer`` and of every optimizer it wraps (Lightning's wrapper,
    DeepSpeed's ZeRO optimizer around a torch one)."""
    found: list[torch.Tensor] = []
    seen = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        if isinstance(optimizer, torch.optim.Optimizer):
            for group in optimizer.param_groups:
                found.extend(p for p in group["params"] if isinstance(p, torch.Tensor))
            for state in optimizer.state.values():
                found.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        optimizer = pl_compat.wrapped_optimizer(optimizer)
    return found


class LightningFileWriter:
    """The deadline save of strategies that write one Lightning file from rank 0 (one process, DDP)."""

    def __init__(self, trainer: "pl.Trainer", path: Path, state_key: str) -> None:
        self.trainer, self.path, self.state_key = trainer, path, state_key

    def write_part(self, snapshot: Snapshot) -> None:
        return None  # rank 0 writes the whole file

    def commit(self, snapshot: Snapshot, parts: list[dict[str, Any]]) -> Path:
        checkpoint = with_rank_parts(dict(snapshot.checkpoint or {}), self.state_key, parts)
        claim_last(self.trainer, self.path, checkpoint)
        self.trainer.strategy.checkpoint_io.save_checkpoint(checkpoint, self.path)
        return self.path


class PartwiseFolderWriter:
    """The deadline save of a strategy whose processes each write part of a checkpoint folder (DeepSpeed ZeRO,
    through :class:`~lit_speed.interfaces.PartwiseCheckpointWriter`): every process writes its optimizer shard into
    a staging folder, rank 0 the model states and ``latest``, then swaps the folder in (the old one becomes
    ``last.ckpt.prev``)."""

    def __init__(self, trainer: "pl.Trainer", path: Path, state_key: str) -> None:
        self.trainer, self.path, self.state_key = trainer, path, state_key
        self.tag = ds_compat.zero_checkpoint_tag()
        self.strategy: PartwiseCheckpointWriter = trainer.strategy  # type: ignore[assignment]

    def staging(self, snapshot: Snapshot) -> Path:
        return self.path.with_name(f"{self.path.name}.deadline-{snapshot.updates}")

    def write_part(self, snapshot: Snapshot) -> None:
        self.strategy.write_optimizer_part(str(self.staging(snapshot)))

    def commit(self, snapshot: Snapshot, parts: list[dict[str, Any]]) -> Path:
        staging = self.staging(snapshot)
        client = {k: v for k, v in (snapshot.checkpoint or {}).items() if k not in ("state_dict", "optimizer_states")}
        client = with_rank_parts(client, self.state_key, parts)
        claim_last(self.trainer, self.path, client)
        self.strategy.write_model_states(str(staging), snapshot.extra["module"], client)
        (staging / "latest").write_text(self.tag)
        previous = self.path.with_name(self.path.name + ".prev")
        if previous.exists():
            shutil.rmtree(previous) if previous.is_dir() else previous.unlink()
        if self.path.exists():
            self.path.rename(previous)
        staging.rename(self.path)
        for stale in self.path.parent.glob(f"{self.path.name}.deadline-*"):
            shutil.rmtree(stale, ignore_errors=True)
        return self.path


def with_rank_parts(checkpoint: dict[str, Any], state_key: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    """``checkpoint`` with every process's RNG and metric states in FaultTolerance's state (as a save by all of
    them would have gathered)."""
    callbacks = dict(checkpoint.get("callbacks") or {})
    state = dict(callbacks.get(state_key) or {})
    if len(parts) > 1:
        state["rng_per_rank"] = [p["rng"] for p in parts]
        state["metrics_per_rank"] = [p["metrics"] for p in parts]
    callbacks[state_key] = state
    checkpoint["callbacks"] = callbacks
    return checkpoint


class SignalStop:
    """The stop-signal half of :class:`~lit_speed.checkpointing.FaultTolerance` for one fit.

    Args:
        trainer: The Trainer being fitted.
        deadline_s: Seconds from a signal to the exit (``None``: wait for the running batch, however long).
        state_key: FaultTolerance's key in ``checkpoint["callbacks"]``.
    """

    def __init__(self, trainer: "pl.Trainer", deadline_s: float | None, state_key: str) -> None:
        self.trainer, self.deadline_s, self.state_key = trainer, deadline_s, state_key
        self.gate: StepGate | None = None
        self.watchdog: DeadlineWatchdog | None = None
        self.save_seconds: list[float] = []
        self.capturing = False  # FaultTolerance.state_dict is being read for a snapshot (no collective, no I/O)
        self.signum: int | None = None
        self._snapshot_before_validation = False  # the last snapshot predates this batch's validation
        self.after_batch_end = False  # after_batch has run for the current batch (its step is counted for loggers)
        loops.replace_sigterm_notifier(trainer, INBOX.handler)  # record only: no collective inside the handler
        loops.replace_stop_broadcast(trainer, lambda: None)  # the decision after each batch replaces it
        loops.call_after_each_batch(trainer, self.after_batch)
        loops.around_each_save(trainer, self._before_save, self.save_seconds.append)
        if deadline_s is not None:
            reason = self._unsupported()
            if reason is None:
                self.gate = StepGate()
            else:
                rank_zero_warn(f"FaultTolerance(signal_deadline_s={deadline_s:g}) is off for this run: {reason}. A "
                               "stop signal still saves after the running batch.")

    def _unsupported(self) -> str | None:
        strategy = self.trainer.strategy
        if isinstance(strategy, DeepSpeedStrategy):
            if not isinstance(strategy, PartwiseCheckpointWriter):
                return (f"{type(strategy).__name__} cannot write its checkpoint parts without a collective (use "
                        "strategy=zero2, lit_speed.ZeroStrategy)")
            return "ZeRO stage 3 gathers the weights with a collective to save them" if strategy.zero_stage_3 else None
        if type(strategy).__name__.startswith(("FSDP", "ModelParallel")):
            return f"{type(strategy).__name__} saves with collectives"
        return None

    # ------------------------------------------------------------------------------------------ hooks
    def on_train_start(self) -> None:
        if self.gate is None or self.watchdog is not None:
            return
        trainer = self.trainer
        channel = PeerChannel.connect(trainer.global_rank, trainer.world_size)
        writer_type = PartwiseFolderWriter if isinstance(trainer.strategy, PartwiseCheckpointWriter) else LightningFileWriter
        writer = writer_type(trainer, last_checkpoint_path(trainer), self.state_key)
        self.watchdog = DeadlineWatchdog(self.deadline_s, self.gate, writer, trainer.global_rank, trainer.world_size,
                                         channel, self.expected_write_s, self.describe, self.flush_loggers)
        self.watchdog.start()

    def before_update(self) -> None:
        if self.gate is not None and not pl_compat.should_accumulate(self.trainer):
            self.gate.before_update()

    def before_validation(self) -> None:
        """Validation inside fit, after the batch's update: snapshot now, so that a deadline that comes during a long
        validation saves that step (a resume then skips this validation, as after Lightning's own checkpoint there)."""
        gate, trainer = self.gate, self.trainer
        if gate is not None and gate.updating and trainer.training is False and not trainer.sanity_checking:
            gate.consistent(self.snapshot())
            self._snapshot_before_validation = True

    def after_batch(self) -> None:
        """End of each training batch (after its validation and checkpoints), in every process in the same order."""
        self.after_batch_end = True
        trainer, gate = self.trainer, self.gate
        if gate is not None:
            gate.hold()
        signum = self.agree()
        if gate is not None and (gate.updating or self._snapshot_before_validation):
            self._snapshot_before_validation = False
            gate.consistent(self.snapshot())  # (after validation: the snapshot a resume needs not skip it)
        if signum:
            self.signum = signum
            loops.set_received_sigterm(trainer)
            if not loops.training_done_after_this_batch(trainer):  # else Lightning raises at the epoch's end
                raise SIGTERMException

    def agree(self) -> int:
        """The signal any process received (0: none), the same answer in every process (one all-reduce)."""
        mine = INBOX.signum or 0
        if self.trainer.world_size < 2:
            return mine
        flag = torch.tensor([mine], device=self.trainer.strategy.root_device, dtype=torch.int32)
        return int(self.trainer.strategy.reduce(flag, reduce_op="max").item())

    def begin_polite_save(self) -> None:
        if self.gate is not None:
            self.gate.begin_polite_save()

    def end(self) -> None:
        if self.watchdog is not None:
            self.watchdog.end()
            self.watchdog = None

    def _before_save(self) -> None:
        if self.gate is not None:
            self.gate.hold()  # once a watchdog owns the state, nothing else writes a checkpoint

    # ------------------------------------------------------------------------------------------ snapshots
    def snapshot(self) -> Snapshot:
        """The state after the update just completed: what ``Trainer.save_checkpoint`` would write (rank 0 only:
        it alone writes it), weights and optimizer state kept by reference, the rest copied."""
        trainer = self.trainer
        live = storage_ids([*trainer.lightning_module.parameters(),
                            *(t for opt in trainer.optimizers for t in optimizer_tensors(opt))])
        checkpoint, extra = None, {}
        if trainer.is_global_zero:
            self.capturing = True
            try:
                checkpoint = keep_live_copy_rest(loops.dump_checkpoint(trainer), live)
            finally:
                self.capturing = False
            if isinstance(trainer.strategy, PartwiseCheckpointWriter):
                extra["module"] = keep_live_copy_rest(trainer.strategy.module_state_for_checkpoint(), live)
        return Snapshot(self.gate.updates if self.gate else 0, trainer.global_step, checkpoint,
                        rank_part(trainer.lightning_module), extra)

    def expected_write_s(self) -> float:
        """How long a save takes here: the slowest one timed in this run, else an estimate from the state's size."""
        if self.save_seconds:
            return 1.5 * max(self.save_seconds)
        trainer = self.trainer
        tensors = [*trainer.lightning_module.parameters(), *(t for o in trainer.optimizers for t in optimizer_tensors(o))]
        return 0.5 + sum(t.numel() * t.element_size() for t in tensors) / SAVE_BYTES_PER_S

    def flush_loggers(self) -> None:
        for logger in self.trainer.loggers:
            logger.save()

    def describe(self, step: int, path: Path | None, signum: int, problem: str) -> str:
        """The line rank 0 prints when the deadline ends the run."""
        trainer, name = self.trainer, signal_name(signum)
        if path is not None:
            return (f"interrupted at step {step}; resume with {resume_hint(trainer, path)} hydra.run.dir="
                    f"{run_folder(trainer)} ({name}; step {step} saved: the running step {step + 1} would have ended "
                    f"after the {self.deadline_s:g} s deadline, so the last completed step was saved; checkpoint "
                    f"{path})")
        try:
            last = last_good_checkpoint(checkpoint_folders(trainer))
        except Exception as error:  # noqa: BLE001 - a damaged folder must not hide the stop
            last = f"none usable ({error})"
        kept = f"the last checkpoint that verifies is {last}" if last else "no checkpoint was written in this run"
        return (f"{name}: stopped at the {self.deadline_s:g} s deadline without saving ({problem}); {kept}. Resume "
                f"with ckpt_path=last hydra.run.dir={run_folder(trainer)}")


def stop_signal_received(trainer: "pl.Trainer") -> tuple[str, int] | None:
    """A stop signal that came after the last training batch was decided (during the epoch's end, the final
    validation, ...): ``(message, exit code)`` for the runner to stop with; ``None`` if none came."""
    if INBOX.signum is None:
        return None
    try:
        last = last_good_checkpoint(checkpoint_folders(trainer))
    except Exception as error:  # noqa: BLE001 - a damaged folder must not hide the stop
        last = f"none usable ({error})"
    return (f"{signal_name(INBOX.signum)} after training had finished at step {trainer.global_step}: the last "
            f"checkpoint is {last}; what was left (final validation, summary) was skipped.", 128 + INBOX.signum)
