"""FLOPs per batch, and the peak the device could deliver: the two halves of MFU.

- :class:`FlopCount` counts one forward+backward with the FLOP formulas of ``torch.utils.flop_counter``
  (matmuls, convolutions, attention: the work that dominates a training step) in a plain dispatch mode: the same
  total as ``FlopCounterMode`` plus the CPU's fused attention (which it has no formula for), grouped-query attention
  counted on every torch (older ones assert), without its per-module tracker, whose hooks kept a checkpointed model's
  recomputed activations alive through backward (x2.1 of the step's tensor peak at 4 Llama-1B-width layers, 2 x 256
  tokens; on the 1B-dims LoRA run the first batch's RSS rose from 7.7 to 14.2 GiB during backward).
- :func:`measure_cpu_peak_flops` times a short square matmul once per (dtype, threads) and caches it:
  the CPU has no datasheet number we could look up, and its real peak depends on the ISA
  (AVX2, AVX512, AMX) and on the thread count.
- :func:`gpu_peak_flops` looks the GPU's name up in a table of dense datasheet peaks.
"""
from __future__ import annotations

import functools
import time

import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import flop_registry

from lit_speed.compat import torch as torch_compat

# Dense (no sparsity) peak FLOP/s from NVIDIA datasheets, the same sources Lightning 2.6.6 cites in
# lightning/fabric/utilities/throughput.py. Matched in order by substrings of the lower-case device name,
# so the more specific names come first. "tf32" is fp32 matmuls run on tensor cores.
_GPU_PEAKS: tuple[tuple[tuple[str, ...], dict[str, float]], ...] = (
    (("h100", "pcie"), {"fp32": 51.2e12, "tf32": 378e12, "bf16": 756e12, "fp16": 756e12}),
    (("h100",), {"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12}),  # SXM
    (("h200",), {"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12}),  # same GH100 compute
    (("a100",), {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12}),
    (("l40s",), {"fp32": 91.6e12, "tf32": 183e12, "bf16": 362e12, "fp16": 362e12}),
    (("l40",), {"fp32": 90.5e12, "tf32": 90.5e12, "bf16": 181e12, "fp16": 181e12}),
    (("l4",), {"fp32": 30.3e12, "tf32": 60e12, "bf16": 121e12, "fp16": 121e12}),
    (("rtx 4090",), {"fp32": 82.6e12, "tf32": 82.6e12, "bf16": 82.6e12, "fp16": 82.6e12}),
    (("rtx 3090",), {"fp32": 35.6e12, "tf32": 35.6e12, "bf16": 35.6e12, "fp16": 35.6e12}),
    (("v100",), {"fp32": 15.7e12, "fp16": 125e12}),  # no bf16 units
    (("t4",), {"fp32": 8.1e12, "fp16": 65e12}),  # no bf16 units
)

_DTYPE_KEYS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def gpu_peak_flops(name: str, dtype: torch.dtype, tf32: bool = False) -> float | None:
    """Datasheet peak FLOP/s of a GPU by its name (``torch.cuda.get_device_name()``), or None if unknown.

    Args:
        name: Device name, e.g. ``"NVIDIA A100-SXM4-80GB"``.
        dtype: Compute dtype of the matmuls.
        tf32: fp32 matmuls run on tensor cores (``torch.get_float32_matmul_precision() != "highest"``).
    """
    key = _DTYPE_KEYS.get(dtype)
    if key == "fp32" and tf32:
        key = "tf32"
    lowered = name.lower()
    for patterns, peaks in _GPU_PEAKS:
        if all(p in lowered for p in patterns):
            return peaks.get(key) if key else None
    return None


@functools.lru_cache(maxsize=None)
def _cached_cpu_peak(dtype: torch.dtype, threads: int, size: int, seconds: float) -> float:
    # a generator of its own: the probe may run mid-training (the first batch), where drawing from the global RNG
    # would move dropout and shuffling away from the uninterrupted run's
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(dtype)
    b = torch.randn(size, size, generator=gen).to(dtype)
    flops = 2.0 * size**3
    torch.mm(a, b)  # warm-up: first call allocates and picks the kernel
    best = float("inf")
    deadline = time.perf_counter() + seconds
    repeats = 0
    while repeats < 3 or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
        repeats += 1
        if repeats >= 50:
            break
    return flops / best


def measure_cpu_peak_flops(dtype: torch.dtype = torch.float32, size: int = 1024, seconds: float = 0.2) -> float:
    """Best-of-several square matmul rate (FLOP/s) on this CPU with the current thread count; cached per process.

    The best repeat, not the median, because the peak is what MFU divides by: on a shared machine the
    median would drift with other processes' load. A run that shares cores still sees a lower peak than
    an idle machine; pass ``peak_flops`` to :class:`~lit_speed.DeviceStatsLogger` to pin it.

    Raises:
        ValueError: If ``size`` < 64 or ``seconds`` <= 0.
    """
    if size < 64:
        raise ValueError(f"size must be >= 64 (a smaller matmul measures call overhead, not the peak), got {size}")
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    return _cached_cpu_peak(dtype, torch.get_num_threads(), size, seconds)


def contains_compiled(module: torch.nn.Module) -> bool:
    """Whether any part of ``module`` is ``torch.compile``-d (wrapped, or compiled in place).

    FLOP counting runs the batch under a ``TorchDispatchMode``, and dynamo skips, and may never again
    compile, a frame first called under one (pytorch/pytorch#190286, #140909): counting the first batch
    of a compiled model could silently undo the compilation, so the logger does not count it.
    """
    return any(torch_compat.is_compiled_wrapper(m) or torch_compat.is_compiled(m) for m in module.modules())


def _cpu_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            *args, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


#: ops the registry has no formula for (torch 2.13): the CPU's fused attention, counted as torch counts the CUDA
#: attention kernels (dense SDPA, forward and backward)
_MORE_FORMULAS = {getattr(torch.ops.aten, name): formula for name, formula in (
    ("_scaled_dot_product_flash_attention_for_cpu", _cpu_attention),
    ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_attention_backward))
    if hasattr(torch.ops.aten, name)}


def _heads_broadcast(args: tuple) -> tuple | None:
    """``args`` with every 4-D tensor of fewer heads (dim 1) than the most, and a divisor of it, replaced by a meta
    tensor of the most heads: grouped-query attention's key/value as the kernel uses them (each query head against
    its group's key/value head). None when no tensor changes."""
    heads = max((a.shape[1] for a in args if isinstance(a, torch.Tensor) and a.dim() == 4), default=0)
    out, changed = [], False
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() == 4 and a.shape[1] != heads and heads % a.shape[1] == 0:
            a, changed = torch.empty((a.shape[0], heads, *a.shape[2:]), dtype=a.dtype, device="meta"), True
        out.append(a)
    return tuple(out) if changed else None


def op_flops(func, args: tuple, kwargs: dict, out) -> int:  # noqa: ANN001 - an OpOverload
    """FLOPs of one dispatched op by ``torch.utils.flop_counter``'s formula (0 for an op without one; the CPU's
    fused attention by the formula of the CUDA kernels).

    torch before 2.12 asserts in its attention formulas on grouped-query attention (SDPA with ``enable_gqa``, which
    transformers uses on CUDA for Llama/Qwen-style models): such a call is counted with key/value broadcast to the
    query's heads, which is what the kernel computes and what later torch counts."""
    formula = flop_registry.get(func.overloadpacket) or _MORE_FORMULAS.get(func.overloadpacket)
    if formula is None:
        return 0
    try:
        return int(formula(*args, **kwargs, out_val=out))
    except AssertionError:
        widened = _heads_broadcast(args)
        if widened is None:
            raise
        return int(formula(*widened, **kwargs, out_val=out))


class _CountFlops(torch_compat.TorchDispatchMode):
    """Adds ``torch.utils.flop_counter``'s formula of every op that has one; keeps no reference to any tensor. A
    formula that fails stops the count (``error``: the op and why), never the step."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.error: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's signature
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.error is None:
            try:
                self.total += op_flops(func, args, kwargs, out)
            except Exception as error:  # noqa: BLE001 - a FLOP formula must never fail the training step
                self.error = f"{func.overloadpacket}: {type(error).__name__}: {error}"
        return out


class FlopCount:
    """Count FLOPs between :meth:`start` and :meth:`stop`, which may be called from different hooks.

    Example::

        counter = FlopCount()
        counter.start(); loss = model(x).sum(); loss.backward(); flops = counter.stop()
    """

    def __init__(self) -> None:
        self._mode: _CountFlops | None = None
        self.error: str | None = None  # why the last count failed (then :meth:`stop` returned 0)

    @property
    def active(self) -> bool:
        return self._mode is not None

    def start(self) -> None:
        self._mode = _CountFlops()
        self._mode.__enter__()

    def stop(self) -> int:
        """Leave the counting mode; return the FLOPs counted (0 if it was not started)."""
        if self._mode is None:
            return 0
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        self.error = mode.error
        return 0 if mode.error else mode.total
