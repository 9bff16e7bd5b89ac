"""Which DeepSpeed accelerator a run uses: chosen from the device the run trains on, when it starts.

DeepSpeed fixes its accelerator the first time anything calls ``deepspeed.accelerator.get_accelerator()``
(often at import), from ``DS_ACCELERATOR`` or its own detection, and keeps it for the life of the process.
An import made while ``DS_ACCELERATOR=cpu`` was set (as CPU test set-ups and scripts do) would then run
ZeRO on a CUDA device with DeepSpeed's CPU accelerator, and the reverse order breaks CPU runs.
:func:`use_deepspeed_accelerator` replaces the cached choice at strategy setup, where the device is known;
:func:`default_accelerator_name` is the environment default for scripts and tests (no DeepSpeed import).
"""
from __future__ import annotations

import os

DS_ACCELERATORS = ("cpu", "cuda")


def default_accelerator_name() -> str:
    """``"cuda"`` when torch sees a CUDA device, else ``"cpu"`` (the value to give ``DS_ACCELERATOR``)."""
    import torch

    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"


def use_deepspeed_accelerator(name: str) -> bool:
    """Make DeepSpeed's process-wide accelerator ``name``, whatever was chosen at import.

    Also sets ``DS_ACCELERATOR`` so that processes started from this one (launchers, JIT op builds)
    agree. Call it before ``deepspeed.init_distributed`` / ``deepspeed.initialize``.

    Args:
        name: ``"cpu"`` or ``"cuda"``: the device type the run trains on.

    Returns:
        True if the accelerator was switched, False if it already was ``name``.

    Raises:
        ValueError: If ``name`` is not one of :data:`DS_ACCELERATORS`.
    """
    if name not in DS_ACCELERATORS:
        raise ValueError(f"DeepSpeed accelerator must be one of {DS_ACCELERATORS}, got {name!r}")
    from deepspeed.accelerator import get_accelerator, set_accelerator

    os.environ["DS_ACCELERATOR"] = name
    if get_accelerator().device_name() == name:
        return False
    if name == "cuda":
        from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

        accelerator = CUDA_Accelerator()
    else:
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        accelerator = CPU_Accelerator()
    set_accelerator(accelerator)  # DeepSpeed's public switch; its memory readers follow inside
    return True                   # lit_speed.compat.deepspeed.memory_readers_follow_accelerator (ZeroStrategy)
