"""Where freed tensor memory goes (Linux, glibc): back to the operating system (RSS follows the tensors) or kept in
the process for the next step (no page faults: faster).

torch's CPU tensors come from ``malloc``. glibc serves a request above its mmap threshold with its own ``mmap`` and
returns it to the system on ``free``; below it, from heaps that keep freed memory for reuse. The threshold starts at
128 KiB and **rises to the size of each large block freed** (up to 32 MiB), so after the first steps a training loop's
activations and gradients live in heaps, and what they free stays in the process: on the 1B-dims LoRA step (2 x 512
tokens, bf16 base, chunked loss, checkpointing; Zen3) the RSS peaked at 6.23 GiB for 1.61 GiB of step
tensors over a 2.82 GiB model, and at 4.46 GiB with the threshold pinned at 256 KiB (same loss). Pinning it
(``mallopt(M_MMAP_THRESHOLD)``, the same as ``MALLOC_MMAP_THRESHOLD_=262144`` in the environment) stops the rise.
The price is a fresh mapping, zero-filled by the kernel, for every large tensor: more page faults and system time,
measured in ``benchmarks/bench_real_size.py`` (speed suite); use it when memory decides whether a run fits.

The other way, :class:`KeepFreedMemory`: blocks above 32 MiB (a 0.5B model's MLP activations, logits, the
embedding's gradient) are always mapped and unmapped, and the kernel zero-fills every page of a fresh mapping.
On the 0.5B-dims LoRA step (4 x 512 tokens, float32, 4 of its 24 layers; Zen3) that was 1.6-1.8 million
page faults and 9-10 s of system time per 25 s step. ``mallopt(M_MMAP_MAX, 0)`` serves every block from the heap and
``M_TRIM_THRESHOLD`` at its maximum keeps freed heap memory: after two warm-up steps 0 faults, 0.0 s system time,
18.9 s per step (x0.76), at a higher peak RSS (9.6 GiB against 6.1 GiB there; the whole 0.5B LoRA run: 14.8 GiB
against the 7.7 GiB predicted without it). It gives the memory back and stops keeping when available memory runs
short. Use it when speed matters and the memory is there; ``scripts/train.py`` refuses it together with
:class:`ReturnFreedMemory`.

Example::

    trainer = Trainer(callbacks=[ReturnFreedMemory()])     # or scripts/train.py 'callbacks=[default,return_freed_memory]'
    trainer = Trainer(callbacks=[KeepFreedMemory()])       # or scripts/train.py 'callbacks=[default,keep_freed_memory]'
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

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
KEEP_TRIM_BYTES = 2**31 - 1  # mallopt takes an int: the largest trim threshold it can set (2 GiB of free heap top)
DEFAULT_MMAP_MAX = 65536  # glibc's defaults, restored when keeping stops
DEFAULT_TRIM_BYTES = 128 * 1024
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


def _warn_no_glibc(owner: str, key: str) -> None:
    rank_zero_warn(f"{owner}: no effect here ({platform.system()}, {platform.libc_ver()[0] or 'no glibc'}): mallopt "
                   f"is glibc's. Fix: drop {key} from callbacks on this machine")


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
        _refuse_both(trainer, self, KeepFreedMemory)
        self.apply()

    def apply(self) -> bool:
        """Pin the threshold now (once; ``setup`` calls it too). ``scripts/train.py`` calls it before the weights
        load, so that what loading and preparing the model free (conversions of the read weights, a lowered base's
        float32 copy) goes back under the same rule as the steps' tensors, not only what is freed after ``setup``."""
        if self.applied is None:
            self.applied = return_freed_memory(self.threshold_kib)
            if self.applied:
                rank_zero_info(f"ReturnFreedMemory: glibc's mmap threshold pinned at {self.threshold_kib} KiB: freed "
                               "tensors go back to the system")
            else:
                _warn_no_glibc("ReturnFreedMemory", "return_freed_memory")
        return self.applied

    def describe(self) -> dict[str, str]:
        """The start-up table's row."""
        return {"freed memory": f"returned to the system (glibc mmap threshold {self.threshold_kib} KiB)"}

    def final_summary(self) -> dict[str, Any]:
        return {"threshold_kib": self.threshold_kib, "applied": self.applied}


def _refuse_both(trainer: "pl.Trainer", this: Callback, other: type) -> None:
    if any(isinstance(c, other) for c in trainer.callbacks):
        raise ValueError(f"{type(this).__name__} and {other.__name__} are both in the Trainer's callbacks: one keeps "
                         "freed memory in the process, the other returns it to the system. Fix: keep one "
                         "(scripts/train.py: callbacks=[default,keep_freed_memory] for speed, "
                         "callbacks=[default,return_freed_memory] for memory)")


def trim_heap() -> bool:
    """Hand the free memory glibc's heaps hold back to the OS now (``malloc_trim(0)``), once; False off glibc."""
    libc = glibc()
    return bool(libc is not None and libc.malloc_trim(0) in (0, 1))


def keep_freed_memory() -> bool:
    """Serve every allocation from glibc's heaps (``M_MMAP_MAX=0``) and never trim them (``M_TRIM_THRESHOLD``
    at its maximum): freed tensors stay in the process and the next step reuses them without page faults.

    Returns:
        Whether it took effect (False off glibc).
    """
    libc = glibc()
    return bool(libc is not None and libc.mallopt(M_MMAP_MAX, 0) == 1
                and libc.mallopt(M_TRIM_THRESHOLD, KEEP_TRIM_BYTES) == 1)


def stop_keeping_freed_memory() -> bool:
    """Undo :func:`keep_freed_memory`: glibc's defaults back (large blocks mapped, the heap trimmed) and the free
    memory the heaps hold handed back now (``malloc_trim(0)``). Returns whether it took effect."""
    libc = glibc()
    return bool(libc is not None and libc.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX) == 1
                and libc.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_BYTES) == 1 and trim_heap())


class KeepFreedMemory(Callback):
    """Apply :func:`keep_freed_memory` at ``setup`` (every process of the run; it lasts for the process), while the
    machine has memory to spare.

    Faster steps at a higher peak RSS (module docstring: measured). The extra is what glibc keeps, not what the run
    needs, so it is given back when memory runs short: after every backward, training batch and validation batch,
    if the memory available to new allocations is below ``min_available_fraction`` of the machine's, keeping stops
    (:func:`stop_keeping_freed_memory`) for the rest of the process, with a warning and ``released_at_step`` in the
    summary. Refused beside :class:`ReturnFreedMemory`.

    ``scripts/train.py`` adds it to a Hugging Face model's run whose callbacks name neither (``by_default``: the
    start-up table says so, and how to return freed memory instead).

    Args:
        min_available_fraction: Stop keeping when less than this fraction of the machine's memory is available.
        by_default: Added by ``scripts/train.py``, not configured (its start-up row says so).
    """

    def __init__(self, min_available_fraction: float = 0.15, by_default: bool = False) -> None:
        if isinstance(min_available_fraction, bool) or not isinstance(min_available_fraction, (int, float)) \
                or not 0.0 < min_available_fraction < 1.0:
            raise ValueError(f"KeepFreedMemory(min_available_fraction={min_available_fraction!r}): a fraction of "
                             "the machine's memory, between 0 and 1. Fix: min_available_fraction=0.15")
        self.min_available_fraction = float(min_available_fraction)
        self.by_default = by_default
        self.applied: bool | None = None
        self.released_at_step: int | None = None

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        _refuse_both(trainer, self, ReturnFreedMemory)
        if self.applied is not None:
            return
        self.applied = keep_freed_memory()
        if self.applied:
            rank_zero_info("KeepFreedMemory: glibc serves every block from its heaps and keeps what is freed: no "
                           "page faults for the next step's tensors, a higher peak RSS (given back if available "
                           f"memory falls below {self.min_available_fraction:.0%})")
        elif not self.by_default:  # added by default: its start-up row and summary say it did nothing here
            _warn_no_glibc("KeepFreedMemory", "keep_freed_memory")

    def _check(self, trainer: "pl.Trainer") -> None:
        if not self.applied or self.released_at_step is not None:
            return
        from lit_speed.memory.host_memory import host_memory

        memory = host_memory()
        if memory.available >= self.min_available_fraction * memory.total:
            return
        stop_keeping_freed_memory()
        self.released_at_step = trainer.global_step
        rank_zero_warn(f"KeepFreedMemory: {memory.available / 2**30:.1f} GiB of {memory.total / 2**30:.1f} GiB "
                       f"available (< {self.min_available_fraction:.0%}) at step {trainer.global_step}: freed memory "
                       "handed back and no longer kept (glibc's defaults) for the rest of the run")

    @override
    def on_after_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._check(trainer)

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", *args: Any, **kwargs: Any) -> None:
        self._check(trainer)

    @override
    def on_validation_batch_end(self, trainer: "pl.Trainer", *args: Any, **kwargs: Any) -> None:
        self._check(trainer)

    def describe(self) -> dict[str, str]:
        """The start-up table's row."""
        if self.by_default and glibc() is None:
            return {"freed memory": f"the C library's defaults ({platform.libc_ver()[0] or 'not glibc'}: no mallopt)"}
        why = " (the default for a Hugging Face model; callbacks=[default,return_freed_memory] returns it)" \
            if self.by_default else ""
        return {"freed memory": "kept in the process for reuse (glibc: no mmap, no trim) while more than "
                                f"{self.min_available_fraction:.0%} of memory is available{why}"}

    def final_summary(self) -> dict[str, Any]:
        return {"applied": self.applied, "min_available_fraction": self.min_available_fraction,
                "released_at_step": self.released_at_step}
