"""Private torch names lit_speed uses (written against torch 2.13).

Re-exported names are used as they are: ``TorchDispatchMode`` (``torch.utils._python_dispatch``, the
documented way to write a dispatch mode), ``tree_leaves`` / ``tree_map`` (``torch.utils._pytree``, torch's own
flattening of nested containers, namedtuples included) and ``OptimizedModule`` (``torch._dynamo.eval_frame``,
what ``torch.compile(module)`` returns; imported on first use, since importing dynamo is slow).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

__all__ = ["CAST_OP", "TorchDispatchMode", "cpu_has_native_bf16", "foreach_copy_", "foreach_max_abs", "foreach_mul_",
           "is_compiled", "is_compiled_wrapper", "sparse_values", "tree_leaves", "tree_map", "uncompile"]


#: The aten op ``Tensor.to(dtype)`` dispatches to when it copies (``aten._to_copy``; a dispatch mode sees it, not ``to``).
CAST_OP = torch.ops.aten._to_copy.default


def foreach_mul_(tensors: Sequence[torch.Tensor], scalar: float) -> None:
    """Multiply every tensor in place by ``scalar`` in one fused kernel launch (``torch._foreach_mul_``)."""
    torch._foreach_mul_(tensors, scalar)


def foreach_max_abs(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The largest absolute value of each tensor, NaN where a tensor holds one (``torch._foreach_norm`` with
    ``ord=inf``, the op ``clip_grad_norm_`` uses for its norms: one multi-tensor kernel on CUDA for tensors of one
    device and dtype, a reduction per tensor without temporaries on the CPU)."""
    return list(torch._foreach_norm(tensors, float("inf")))


def foreach_l2(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The L2 norm of each tensor (``torch._foreach_norm`` with ``ord=2``), in the tensors' dtype: NaN or inf where a
    tensor holds one, and inf also where finite values overflow the sum of squares. On the CPU 5-8x faster than
    :func:`foreach_max_abs` (torch 2.13: 0.33 vs 2.6 ms for a 0.8M-parameter GPT's 27 gradients, 94 vs 454 ms for
    203M float32 elements, on a 2-core Xeon)."""
    return list(torch._foreach_norm(tensors, 2))


def sparse_values(tensor: torch.Tensor) -> torch.Tensor:
    """The stored values of a sparse tensor (COO: ``_values()``, which unlike ``values()`` needs no coalescing;
    CSR/CSC/BSR: ``values()``)."""
    return tensor._values() if tensor.is_sparse else tensor.values()


def foreach_copy_(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """Copy ``sources[i]`` into ``targets[i]`` (dtype-converting) in one fused launch (``torch._foreach_copy_``)."""
    torch._foreach_copy_(targets, sources)


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN reports native bf16 kernels (AVX512-BF16 / AMX) on this CPU
    (``torch.ops.mkldnn._is_mkldnn_bf16_supported``)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without mkldnn: no fast bf16 either
        return False


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` was compiled in place: ``nn.Module.compile()`` stores the compiled call in the private
    ``_compiled_call_impl``."""
    return getattr(module, "_compiled_call_impl", None) is not None


def uncompile(module: nn.Module) -> None:
    """Undo ``nn.Module.compile()``: setting ``_compiled_call_impl`` back to ``None`` restores eager calls."""
    module._compiled_call_impl = None


def is_compiled_wrapper(module: Any) -> bool:
    """Whether ``module`` is the wrapper ``torch.compile(module)`` returns
    (``torch._dynamo.eval_frame.OptimizedModule``)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule)
