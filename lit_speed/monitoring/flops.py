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
- :func:`step_peak_flops` is the one source of MFU's peak: the step's counted FLOPs by the dtype their matmuls ran
  in (a bf16 base, bf16 autocast, float32 adapters: the mix the step really has), each at that dtype's peak on the
  device; :func:`model_flops_utilization` divides by it, never above 1.
"""
from __future__ import annotations

import functools
import time
from typing import Callable, Mapping

import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import flop_registry

from lit_speed.compat import torch as torch_compat
from lit_speed.compat.torch import cpu_has_native_bf16

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


def cpu_peak_flops(dtype: torch.dtype) -> tuple[float, str]:
    """The CPU's peak for matmuls in ``dtype`` and where it comes from. A 16-bit dtype on a CPU without bf16 matmul
    units runs through float32 kernels (converted: small shapes at float32 speed, large ones far slower), so its
    peak is the float32 one (and its slow probe is not run)."""
    threads = torch.get_num_threads()
    if dtype != torch.float32 and not cpu_has_native_bf16():
        return measure_cpu_peak_flops(torch.float32), (f"torch.float32 matmul probe, {threads} threads (this CPU has no "
                                                       f"{dtype} matmul units; its float32 peak is higher)")
    return measure_cpu_peak_flops(dtype), f"{dtype} matmul probe, {threads} threads"


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float | None, str]:
    """The peak FLOP/s of matmuls in ``dtype`` on ``device`` (datasheet on a GPU, a probe on the CPU), and its
    source; ``None`` where it is not known."""
    if device.type == "cuda":
        tf32 = torch.get_float32_matmul_precision() != "highest"
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(name, dtype, tf32)
        return peak, f"datasheet {name} {dtype}" if peak else f"{name} not in the table"
    if device.type == "cpu":
        return cpu_peak_flops(dtype)
    return None, f"no peak known for {device.type} devices"


def step_peak_flops(flops_by_dtype: Mapping[torch.dtype, float],
                    peak_of: Callable[[torch.dtype], tuple[float | None, str]]) -> tuple[float | None, str]:
    """The peak of a step whose FLOPs run in several dtypes: the rate at which the device would do exactly that mix,
    each dtype's FLOPs at that dtype's peak (``total / sum(flops_d / peak_d)``), and its source.

    Args:
        flops_by_dtype: The step's FLOPs by the dtype their matmuls ran in (:attr:`FlopCount.by_dtype`).
        peak_of: ``dtype -> (peak FLOP/s or None, source)``, e.g. ``lambda d: device_peak_flops(device, d)``.

    Example::

        step_peak_flops({torch.bfloat16: 9e9, torch.float32: 1e9}, {torch.bfloat16: (4e11, "bf16"),
                                                                    torch.float32: (2e11, "fp32")}.get)[0]
        # 3.64e11: 10e9 FLOPs in 9e9/4e11 + 1e9/2e11 = 0.0275 s
    """
    counted = sorted(((d, float(f)) for d, f in flops_by_dtype.items() if f > 0), key=lambda kv: -kv[1])
    if not counted:
        return None, "no FLOPs counted"
    total, seconds, sources = sum(f for _, f in counted), 0.0, []
    for dtype, flops in counted:
        peak, source = peak_of(dtype)
        if not peak:
            return None, source
        seconds += flops / peak
        sources.append(source)
    if len(sources) == 1:
        return total / seconds, sources[0]
    return total / seconds, "the step's FLOP mix: " + ", ".join(
        f"{100 * flops / total:.0f}% {dtype} ({source})" for (dtype, flops), source in zip(counted, sources))


def model_flops_utilization(flops_per_sec: float | None, peak_flops: float | None) -> float | None:
    """Achieved FLOP/s over the peak, at most 1 (a run above the peak means the peak was measured low: a small
    probe, a loaded machine); ``None`` when either is unknown."""
    if not flops_per_sec or not peak_flops:
        return None
    return min(flops_per_sec / peak_flops, 1.0)


#: dtypes whose matmuls already run at reduced precision (the verdict does not advise them again)
LOW_PRECISION = (torch.bfloat16, torch.float16)


def low_precision_share(flops_by_dtype: Mapping[torch.dtype, float]) -> float | None:
    """The share of the counted FLOPs that ran in bf16 or fp16 (``None`` when nothing was counted)."""
    total = sum(flops_by_dtype.values())
    return sum(f for d, f in flops_by_dtype.items() if d in LOW_PRECISION) / total if total else None


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


def op_dtype(args: tuple, out: object) -> torch.dtype:
    """The dtype an op's matmul ran in: its first floating-point matrix argument's (``addmm``'s bias is skipped;
    under autocast the arguments are already cast), else its output's."""
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.is_floating_point() and arg.dim() >= 2:
            return arg.dtype
    return out.dtype if isinstance(out, torch.Tensor) else torch.float32


class _CountFlops(torch_compat.TorchDispatchMode):
    """Adds ``torch.utils.flop_counter``'s formula of every op that has one, by the dtype it ran in; keeps no
    reference to any tensor. A formula that fails stops the count (``error``: the op and why), never the step."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.by_dtype: dict[torch.dtype, int] = {}
        self.error: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's signature
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.error is None:
            try:
                flops = op_flops(func, args, kwargs, out)
                if flops:
                    self.total += flops
                    dtype = op_dtype(args, out)
                    self.by_dtype[dtype] = self.by_dtype.get(dtype, 0) + flops
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
        self.by_dtype: dict[torch.dtype, int] = {}  # the last count by the dtype each op ran in

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
        self.by_dtype = {} if mode.error else dict(mode.by_dtype)
        return 0 if mode.error else mode.total
