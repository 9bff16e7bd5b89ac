"""Atomic, verified checkpoints; robust ``ckpt_path=last``; non-finite reporting (the card: README.md beside this
file, "Guarantees")."""
from lit_speed.checkpointing.atomic_checkpoint_io import (
    AtomicCheckpointIO,
    CheckpointWriteError,
    CorruptCheckpointError,
    verify_checkpoint,
)
from lit_speed.checkpointing.best_and_last_checkpoint import BestAndLastCheckpoint
from lit_speed.checkpointing.fault_tolerance import FaultTolerance, is_write_failure, write_failure_message
from lit_speed.checkpointing.resumable_csv_logger import ResumableCSVLogger
from lit_speed.checkpointing.resume import last_good_checkpoint, resolve_ckpt_path
from lit_speed.checkpointing.signal_stop import stop_signal_received

__all__ = ["AtomicCheckpointIO", "BestAndLastCheckpoint", "CheckpointWriteError", "CorruptCheckpointError",
           "FaultTolerance", "ResumableCSVLogger", "is_write_failure", "last_good_checkpoint", "resolve_ckpt_path",
           "stop_signal_received", "verify_checkpoint", "write_failure_message"]
