"""What went wrong, in one line with the fix: out-of-memory, a lost peer process, a checkpoint that could not be
written, non-finite weights (the functions :class:`~lit_speed.checkpointing.FaultTolerance` reports with)."""
from __future__ import annotations

import errno
import shlex
from typing import Any, Sequence

import lightning.pytorch as pl
import torch

from lit_speed.checkpointing.atomic_checkpoint_io import WRITE_ERRNOS, CheckpointWriteError
from lit_speed.checkpointing.preemption import run_folder
from lit_speed.checkpointing.resume import checkpoint_folders, last_good_checkpoint
from lit_speed.oom import is_oom_error

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
    from lit_speed.tensors import finite

    return [name for name, p in module.named_parameters() if p.numel() and not bool(finite(p))]


def loss_value(outputs: Any) -> torch.Tensor | None:
    """The loss a ``training_step`` returned (a tensor, or a dict with ``"loss"``), else ``None``."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None
