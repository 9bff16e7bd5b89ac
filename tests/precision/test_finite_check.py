"""lit_speed.tensors.finite: the same answer as ``torch.isfinite(t).all()``, without a temporary as large as ``t``
(the guard checks every gradient at every step; at 0.5-1B parameters the embedding's alone is 0.5-1 GiB)."""
from __future__ import annotations

import pytest
import torch

from lit_speed.memory.memory_tracker import LiveTensorTracker
from lit_speed.precision.nonfinite import all_finite, first_nonfinite
from lit_speed.tensors import FINITE_CHUNK, finite

N = 4 * FINITE_CHUNK + 3  # several chunks and a short last one


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("where, value", [(None, None), (0, float("nan")), (2 * FINITE_CHUNK + 5, float("inf")),
                                          (N - 1, float("-inf")), (N - 1, float("nan"))])
def test_finite_answers_as_isfinite_all_in_every_chunk(dtype, where, value):
    t = torch.zeros(N, dtype=dtype)
    if where is not None:
        t[where] = value
    assert finite(t).dim() == 0 and bool(finite(t)) == bool(torch.isfinite(t).all()) == (where is None)
    other = torch.zeros(4, N // 4, dtype=dtype)[:, :7].t()  # non-contiguous: checked whole, same answer
    if where is not None:
        other[3, 1] = value
    assert bool(finite(other)) == (where is None)


def test_finite_makes_no_temporary_as_large_as_the_tensor():
    t = torch.zeros(N)
    with LiveTensorTracker() as whole:
        torch.isfinite(t).all()
    with LiveTensorTracker() as chunked:
        finite(t)
    tensor_bytes = t.numel() * t.element_size()
    assert whole.peak_bytes >= tensor_bytes / 4  # what the guard used to cost: at least a mask the tensor's size
    assert chunked.peak_bytes <= 2 * FINITE_CHUNK * t.element_size() < tensor_bytes / 2


def test_the_guard_and_the_end_of_fit_check_use_it():
    grads = [torch.zeros(N), torch.ones(3)]
    assert bool(all_finite(grads))
    grads[0][-1] = float("nan")
    assert not bool(all_finite(grads)) and first_nonfinite([("g0", grads[0]), ("g1", grads[1])]) == "g0 (nan)"
