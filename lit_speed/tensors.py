"""Checks over whole tensors that make no temporary as large as the tensor (a shared module: every component may
import it). At 0.5-1B parameters a gradient or an embedding is 0.5-1 GiB, and a check that copies it is a peak."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor

from lit_speed.compat.torch import foreach_l2, foreach_max_abs, sparse_values


@torch.no_grad()
def all_finite(tensors: Iterable[Tensor]) -> Tensor:
    """A 0-dim bool tensor: every element of every tensor is finite (no device sync).

    One max-|x| reduction per (device, dtype) group (:func:`~lit_speed.compat.torch.foreach_max_abs`:
    ``torch._foreach_norm(ord=inf)``, the op ``clip_grad_norm_`` uses for its norms). On CUDA that is one
    multi-tensor kernel for all of a model's gradients instead of two launches per gradient. On the CPU it makes no
    temporary (``torch.isfinite(t).all()`` makes masks as large as ``t``: 911 MiB above a 0.5B model's float32
    embedding gradient) and reads each tensor once (``benchmarks/bench_finite_check.py``). The maximum propagates NaN
    and keeps inf, so it is finite iff every element is. On the CPU, where reading the answer costs no device sync,
    the L2 norms come first (:func:`~lit_speed.compat.torch.foreach_l2`, 5-8x faster there): finite norms prove every
    element finite, and only a group whose norms are not (a NaN or inf, or finite values whose squares overflow) is
    read again for its maxima. Tensors with no elements, and integer ones, are finite; a sparse tensor is checked by
    its stored values."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    first_device = None
    for t in tensors:
        first_device = t.device if first_device is None else first_device
        if t.layout != torch.strided:  # a sparse gradient (nn.Embedding(sparse=True)): its stored values
            t = sparse_values(t)
        if t.numel() and (t.is_floating_point() or t.is_complex()):
            groups.setdefault((t.device, t.dtype), []).append(t.detach())
    if not groups:
        return torch.ones((), dtype=torch.bool, device=first_device)
    flags = [_group_finite(device, group) for (device, _), group in groups.items()]
    if len(flags) == 1:
        return flags[0]
    return torch.stack([flag.to(flags[0].device) for flag in flags]).all()


def finite(tensor: Tensor) -> Tensor:
    """A 0-dim bool tensor: every element of ``tensor`` is finite (no host sync, no temporary its size)."""
    return all_finite([tensor])


def _group_finite(device: torch.device, group: list[Tensor]) -> Tensor:
    """``all_finite`` of tensors of one device and dtype (see there)."""
    if device.type == "cpu" and bool(torch.isfinite(torch.stack(foreach_l2(group))).all()):
        return torch.ones((), dtype=torch.bool)
    return torch.isfinite(torch.stack(foreach_max_abs(group))).all()
