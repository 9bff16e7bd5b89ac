"""Checks over whole tensors that make no temporary as large as the tensor (a shared module: every component may
import it). At 0.5-1B parameters a gradient or an embedding is 0.5-1 GiB, and a check that copies it is a peak."""
from __future__ import annotations

import torch
from torch import Tensor

#: Elements checked at once by :func:`finite`. ``torch.isfinite(t).all()`` makes temporaries as large as ``t`` (its
#: absolute value and two masks): on the float32 gradient of a 0.5B model's embedding (136M elements) 911 MiB above
#: the tensor, on a 1B model's bf16 embedding 1,254 MiB (measured on Z3), at the moment every gradient is alive.
#: In chunks of 4M elements: 81 MiB.
FINITE_CHUNK = 1 << 22


def finite(tensor: Tensor) -> Tensor:
    """A 0-dim bool tensor: every element of ``tensor`` is finite (no host sync), checked :data:`FINITE_CHUNK`
    elements at a time so that no temporary as large as the tensor is made."""
    tensor = tensor.detach()
    if tensor.numel() <= FINITE_CHUNK or not tensor.is_contiguous():
        return torch.isfinite(tensor).all()
    return torch.stack([torch.isfinite(chunk).all() for chunk in tensor.view(-1).split(FINITE_CHUNK)]).all()
