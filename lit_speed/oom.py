"""Recognise out-of-memory errors in all their disguises (shared by accumulation's OOM retry and fault tolerance).

CUDA reports running out of memory in several ways (``torch.cuda.OutOfMemoryError``, a plain
``RuntimeError`` from cuBLAS/cuDNN/NCCL kernels that failed to allocate workspace); CPU kernels report it
through their allocators.
"""
from __future__ import annotations

import torch

# Substrings of the messages CUDA/cuBLAS/cuDNN/NCCL/MPS and the CPU allocators use for a failed allocation.
OOM_MESSAGES = (
    "out of memory",                         # "CUDA out of memory. Tried to allocate ...", "CUDA error: out of memory"
    "CUBLAS_STATUS_ALLOC_FAILED",            # cuBLAS could not allocate its workspace
    "CUDNN_STATUS_NOT_SUPPORTED",            # cuDNN falls back to this when a workspace does not fit
    "CUDNN_STATUS_ALLOC_FAILED",
    "cuFFT error: CUFFT_ALLOC_FAILED",
    "NCCL error: unhandled cuda error",      # NCCL buffers failing to allocate
    "MPS backend out of memory",
    "DefaultCPUAllocator: can't allocate memory",
    "DefaultCPUAllocator: not enough memory",
    "std::bad_alloc",                        # C++ allocations inside CPU kernels
    "could not create a primitive",          # oneDNN (CPU): its workspace allocation failed (seen under RLIMIT_AS)
)


def is_oom_error(error: BaseException) -> bool:
    """True if ``error`` means an allocation failed (any device), so a smaller micro-batch may succeed.

    Example::

        >>> is_oom_error(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
        True
    """
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    if not isinstance(error, RuntimeError):
        return False
    message = str(error).lower()
    return any(pattern.lower() in message for pattern in OOM_MESSAGES)
