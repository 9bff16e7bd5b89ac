"""Atomic, verified checkpoints; robust ``ckpt_path=last``; non-finite reporting (see README, "What happens
when things go wrong")."""
from lit_speed.checkpointing.atomic_checkpoint_io import (
    AtomicCheckpointIO,
    CorruptCheckpointError,
    verify_checkpoint,
)
from lit_speed.checkpointing.fault_tolerance import FaultTolerance
from lit_speed.checkpointing.resume import last_good_checkpoint, resolve_ckpt_path

__all__ = ["AtomicCheckpointIO", "CorruptCheckpointError", "FaultTolerance", "last_good_checkpoint",
           "resolve_ckpt_path", "verify_checkpoint"]
