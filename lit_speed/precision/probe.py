"""A short CPU probe: how much slower is a bf16/fp16 matmul than fp32 here? Measured once per process.

CPUs without native bf16/fp16 kernels emulate them: on an AVX2 EPYC a 256^2 bf16 matmul measured 57x (and a
2048^2 one 500x) slower than fp32, so ``precision=bf16-mixed`` silently slows training by orders of magnitude.
The decision is a pure function of two timings and a threshold (:func:`slowdown_warning`), so it is tested
with given numbers on any machine; only :func:`measure_slowdown` touches the clock.
"""
from __future__ import annotations

import functools
import time

import torch

from lit_speed.compat import torch as torch_compat

#: Above this ratio (low-precision time / fp32 time) the user is warned, and ``auto`` refuses bf16 on CPU.
DEFAULT_MAX_SLOWDOWN = 2.0


def slowdown_ratio(fp32_seconds: float, low_seconds: float) -> float:
    """Low-precision time over fp32 time (> 1 means the low precision is slower)."""
    if fp32_seconds <= 0 or low_seconds <= 0:
        raise ValueError(f"timings must be > 0 seconds, got fp32={fp32_seconds}, low={low_seconds}")
    return low_seconds / fp32_seconds


def slowdown_warning(dtype: torch.dtype, ratio: float, threshold: float = DEFAULT_MAX_SLOWDOWN,
                     size: int = 256) -> str | None:
    """The warning to show for a measured ``ratio``, or ``None`` when it is within ``threshold``."""
    if ratio <= threshold:
        return None
    name = str(dtype).replace("torch.", "")
    return (f"A {size}x{size} {name} matmul on this CPU measured {ratio:.1f}x slower than float32 (probe): "
            f"this CPU has no fast {name} kernels, so low-precision training will be slower, not faster. "
            f"Use precision=32-true (or precision=auto, which picks it here).")


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN reports native bf16 kernels (AVX512-BF16 / AMX) on this CPU."""
    return torch_compat.cpu_has_native_bf16()


def _best_time(a: torch.Tensor, b: torch.Tensor, rounds: int, inner: int = 2) -> float:
    """Best-of-``rounds`` time of one matmul, each round timing ``inner`` back-to-back calls."""
    torch.mm(a, b)  # warm-up: the first call pays for kernel selection
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(inner):
            torch.mm(a, b)
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


@functools.lru_cache(maxsize=None)
def measure_slowdown(dtype: torch.dtype, size: int = 256, rounds: int = 3) -> float:
    """Time a ``size``^2 matmul in float32 and in ``dtype`` on CPU (best of ``rounds``); return the ratio.

    Runs on one thread: the ratio is about kernel support (native vs emulated), and a single thread is not
    thrown off by a busy machine waking a thread pool. Cached per process: a few milliseconds on a CPU with
    bf16/fp16 kernels, ~0.3 s on one without.
    """
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen)
    b = torch.randn(size, size, generator=gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32 = _best_time(a, b, rounds)
        low = _best_time(a.to(dtype), b.to(dtype), rounds)
    finally:
        torch.set_num_threads(threads)
    return slowdown_ratio(fp32, low)
