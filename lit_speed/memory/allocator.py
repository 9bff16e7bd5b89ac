"""Freed tensor memory back to the operating system, so the process's RSS follows its tensors (Linux, glibc).

torch's CPU tensors come from ``malloc``. glibc serves a request above its mmap threshold with its own ``mmap`` and
returns it to the system on ``free``; below it, from heaps that keep freed memory for reuse. The threshold starts at
128 KiB and **rises to the size of each large block freed** (up to 32 MiB), so after the first steps a training loop's
activations and gradients live in heaps, and what they free stays in the process: on the 1B-dims LoRA step (2 x 512
tokens, bf16 base, chunked loss, checkpointing; Zen3, 2026-11-26) the RSS peaked at 6.23 GiB for 1.61 GiB of step
tensors over a 2.82 GiB model, and at 4.46 GiB with the threshold pinned at 256 KiB (same loss). Pinning it
(``mallopt(M_MMAP_THRESHOLD)``, the same as ``MALLOC_MMAP_THRESHOLD_=262144`` in the environment) stops the rise.
The price is a fresh mapping, zero-filled by the kernel, for every large tensor: more page faults and system time,
measured in ``benchmarks/bench_real_size.py`` (speed suite); use it when memory decides whether a run fits.

Example::

    trainer = Trainer(callbacks=[ReturnFreedMemory()])     # or scripts/train.py 'callbacks=[default,return_freed_memory]'
"""
from __future__ import annotations

import ctypes
import ctypes.util
import platform
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MAX_THRESHOLD_KIB = 32 * 1024  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit


def glibc() -> Any | None:
    """This process's C library when it is glibc (``mallopt`` is glibc's), else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def _check_threshold(threshold_kib: Any) -> None:
    if isinstance(threshold_kib, bool) or not isinstance(threshold_kib, int) or not 1 <= threshold_kib <= \
            MAX_THRESHOLD_KIB:
        raise ValueError(f"ReturnFreedMemory(threshold_kib={threshold_kib!r}): an int in 1..{MAX_THRESHOLD_KIB} "
                         "(glibc's range). Fix: threshold_kib=256")


def return_freed_memory(threshold_kib: int = 256) -> bool:
    """Pin glibc's mmap threshold at ``threshold_kib``: allocations above it are mapped and unmapped on free.

    Returns:
        Whether it took effect (False off glibc).

    Raises:
        ValueError: ``threshold_kib`` is not in 1..32768.
    """
    _check_threshold(threshold_kib)
    libc = glibc()
    return bool(libc is not None and libc.mallopt(M_MMAP_THRESHOLD, threshold_kib * 1024) == 1)


class ReturnFreedMemory(Callback):
    """Apply :func:`return_freed_memory` at ``setup`` (every process of the run; it lasts for the process).

    Args:
        threshold_kib: Allocations above this many KiB get their own mapping, returned to the system when freed.
    """

    def __init__(self, threshold_kib: int = 256) -> None:
        _check_threshold(threshold_kib)
        self.threshold_kib = threshold_kib
        self.applied: bool | None = None

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if self.applied is not None:
            return
        self.applied = return_freed_memory(self.threshold_kib)
        if self.applied:
            rank_zero_info(f"ReturnFreedMemory: glibc's mmap threshold pinned at {self.threshold_kib} KiB: freed "
                           "tensors go back to the system")
        else:
            rank_zero_warn(f"ReturnFreedMemory: no effect here ({platform.system()}, "
                           f"{platform.libc_ver()[0] or 'no glibc'}): mallopt is glibc's. Fix: drop return_freed_memory "
                           "from callbacks on this machine")

    def describe(self) -> dict[str, str]:
        """The start-up table's row."""
        return {"freed memory": f"returned to the system (glibc mmap threshold {self.threshold_kib} KiB)"}

    def final_summary(self) -> dict[str, Any]:
        return {"threshold_kib": self.threshold_kib, "applied": self.applied}
