"""Count live tensor bytes on any device, CPU included: the CPU analogue of ``torch.cuda.max_memory_allocated``.

CPU memory cannot be read per allocation from the allocator, and process RSS is noisy (glibc keeps freed
pages, Python itself holds hundreds of MB). :class:`LiveTensorTracker` instead sees every tensor-producing
op through a ``TorchDispatchMode`` (forward, backward and optimizer ops alike), adds the bytes of each newly
allocated storage and drops them when the storage is freed. What it cannot see: kernel-internal workspaces
that never become tensors, and tensors created before it was entered (count those yourself).
"""
from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from lit_speed.compat.torch import CAST_OP, TorchDispatchMode, tree_leaves


def tensor_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind the tensors in a (nested) container."""
    seen: dict[int, int] = {}
    for t in tree_leaves(tensors):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class LiveTensorTracker(TorchDispatchMode):
    """Peak bytes of tensor storage allocated while the tracker is active and still alive.

    A storage is counted once, when an op returns it and it is not one of the op's inputs (views and in-place
    results share their input's storage and cost nothing). It is uncounted when it is garbage collected.

    Args:
        device_type: Count only storages on this device type (``"cpu"``, ``"cuda"``); ``None`` counts all.

    Example::

        with LiveTensorTracker() as tracker:
            model(x).sum().backward()
        print(tracker.peak_bytes)
    """

    def __init__(self, device_type: str | None = None) -> None:
        super().__init__()
        self.device_type = device_type
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current_bytes = 0
        self.peak_bytes = 0

    def reset_peak(self) -> None:
        """Start a new peak from the bytes alive now (like ``torch.cuda.reset_peak_memory_stats``)."""
        self._sweep()
        self.peak_bytes = self.current_bytes

    def _sweep(self) -> None:
        dead = [key for key, (ref, _) in self._live.items() if ref.expired()]
        for key in dead:
            self.current_bytes -= self._live.pop(key)[1]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self._sweep()
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if _has_storage(t)}
        for t in tree_leaves(out):
            if not _has_storage(t):
                continue
            if self.device_type is not None and t.device.type != self.device_type:
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in inputs or key in self._live:
                continue
            self._live[key] = (StorageWeakRef(storage), nbytes)
            self.current_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        return out


_aten = torch.ops.aten
_MATMULS = {_aten.mm.default: 0, _aten.bmm.default: 0, _aten.addmm.default: 1, _aten.baddbmm.default: 1}
_MATMULS_INTO = {_aten.mm.out: "out", _aten.bmm.out: "out", _aten.addmm.out: "out", _aten.addmm_.default: 0,
                 _aten.baddbmm_.default: 0}


#: A floating-point cast of at least this many elements is skipped too (:class:`SkipMatmuls`): in a probe only weights
#: (a 0.5B model's LM head is 136M) and the logits' gradient are that large, and their values feed only products.
SKIPPED_CAST_ELEMENTS = 1 << 20


class SkipMatmuls(TorchDispatchMode):
    """Matrix products return zeros of their result's shape and dtype instead of computing it: the same tensors are
    allocated (a product always makes a new one, or writes into the one it is given), none of the FLOPs are spent.
    Large floating-point casts (``.to(bf16)`` of a weight, at least :data:`SKIPPED_CAST_ELEMENTS`) also return zeros of
    their result's shape, strides and dtype: under autocast or a chunked loss the probe re-casts the LM head at the
    real vocabulary slice by slice (a quarter of its time at 0.5B dims: 3.2 -> 2.4 s); the values feed only products.

    For measurements of bytes whose values do not matter (:func:`lit_speed.memory.rss_estimate.probe_scaled`): at
    Qwen2.5-0.5B dims the probe's steps were mostly the LM head's products at the real vocabulary. Entered *inside* a
    :class:`LiveTensorTracker`, the tracker sees each zero-filled result as the product it stands for. Zeros keep
    every later kernel on its finite-value path. What differs from a real step: anything whose sizes depend on
    values (a mixture-of-experts router's token counts per expert; their sum is the same).
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        into = _MATMULS_INTO.get(func)
        if into is not None:  # written into a given tensor (out=, in place): nothing new, nothing to compute
            return kwargs[into] if isinstance(into, str) else args[into]
        if func is CAST_OP and _large_float_cast(args[0], kwargs):
            return torch.zeros_like(args[0], dtype=kwargs["dtype"])  # the cast's strides too (preserve_format)
        first = _MATMULS.get(func)
        if first is None:
            return func(*args, **kwargs)
        a, b = args[first], args[first + 1]
        return torch.zeros((*a.shape[:-1], b.shape[-1]), dtype=a.dtype, device=a.device)


def _large_float_cast(x: Any, kwargs: dict) -> bool:
    """A cast from one floating dtype to another (not a copy to another device or layout) of a large tensor."""
    dtype = kwargs.get("dtype")
    return (isinstance(x, torch.Tensor) and dtype is not None and dtype.is_floating_point and x.is_floating_point()
            and dtype != x.dtype and x.numel() >= SKIPPED_CAST_ELEMENTS and kwargs.get("layout") in (None, x.layout)
            and kwargs.get("device") in (None, x.device) and kwargs.get("memory_format") is None)


def _has_storage(t: Any) -> bool:
    """A tensor with memory of its own: not a meta tensor, not a wrapper subclass (e.g. torchao's quantised optimizer
    states, whose ``codes`` and ``scale`` hold the bytes and are seen as they are made)."""
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return False
    if type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter):
        return True
    try:
        t.untyped_storage().data_ptr()
    except RuntimeError:  # "Attempted to access the data pointer on an invalid python storage"
        return False
    return True

