"""lit_speed.tensors.finite / all_finite: the same answer as ``torch.isfinite(t).all()``, without a temporary as large
as ``t`` (the guard checks every gradient at every step; at 0.5-1B parameters the embedding's alone is 0.5-1 GiB),
and one reduction per (device, dtype) group of tensors instead of two launches per tensor."""
from __future__ import annotations

import pytest
import torch

from lit_speed.memory.memory_tracker import LiveTensorTracker
from lit_speed.precision.nonfinite import all_finite, first_nonfinite
from lit_speed.tensors import finite

N = (1 << 24) + 3  # large, and not a multiple of any vector width: a bad last element is in the tail


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("where, value", [(None, None), (0, float("nan")), (N // 2 + 5, float("inf")),
                                          (N - 1, float("-inf")), (N - 1, float("nan"))])
def test_finite_answers_as_isfinite_all_anywhere_in_the_tensor(dtype, where, value):
    t = torch.zeros(N, dtype=dtype)
    if where is not None:
        t[where] = value
    assert finite(t).dim() == 0 and bool(finite(t)) == bool(torch.isfinite(t).all()) == (where is None)
    other = torch.zeros(4, N // 4, dtype=dtype)[:, :7].t()  # non-contiguous: the same answer
    if where is not None:
        other[3, 1] = value
    assert bool(finite(other)) == (where is None)


def test_finite_makes_no_temporary_as_large_as_the_tensor():
    t = torch.zeros(N)
    with LiveTensorTracker() as whole:
        torch.isfinite(t).all()
    with LiveTensorTracker() as reduced:
        finite(t)
    tensor_bytes = t.numel() * t.element_size()
    assert whole.peak_bytes >= tensor_bytes / 4  # what the guard used to cost: at least a mask the tensor's size
    assert reduced.peak_bytes <= 1 << 16  # a handful of 0-dim results


def test_all_finite_mixes_dtypes_and_sizes_and_skips_what_cannot_be_non_finite():
    grads = [torch.zeros(N), torch.ones(3, dtype=torch.bfloat16), torch.ones(2, 2, dtype=torch.float64),
             torch.empty(0), torch.arange(5)]  # an empty tensor and an integer one are finite
    assert bool(all_finite(grads)) and bool(all_finite([])) and bool(finite(torch.empty(0)))
    for i, value in [(1, float("nan")), (2, float("-inf"))]:
        grads[i].view(-1)[-1] = value
        assert not bool(all_finite(grads))
        grads[i].view(-1)[-1] = 1.0
    assert bool(all_finite(grads))
    embedding = torch.nn.Embedding(10, 4, sparse=True)  # a sparse gradient: its values are checked
    embedding(torch.tensor([1, 2])).sum().backward()
    assert embedding.weight.grad.is_sparse and bool(all_finite([embedding.weight.grad, *grads]))
    embedding.weight.grad._values()[1, 3] = float("inf")
    assert not bool(all_finite([embedding.weight.grad, *grads]))
    csr = torch.eye(3).to_sparse_csr()
    assert bool(finite(csr)) and not bool(finite((torch.eye(3) * float("nan")).to_sparse_csr()))
    leaf = torch.ones(4, requires_grad=True)  # a parameter itself (the end-of-fit check): no graph, no error
    assert bool(finite(leaf)) and not finite(leaf).requires_grad


def test_all_finite_is_one_reduction_per_dtype_not_one_per_tensor(monkeypatch):
    grads = [torch.ones(8) for _ in range(300)] + [torch.ones(8, dtype=torch.bfloat16) for _ in range(5)]
    calls: list[int] = []
    real = torch._foreach_norm

    def counting(tensors, *args, **kwargs):
        calls.append(len(tensors))
        return real(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_norm", counting)
    assert bool(all_finite(grads))
    assert sorted(calls) == [5, 300]


def test_the_guard_and_the_end_of_fit_check_use_it():
    grads = [torch.zeros(N), torch.ones(3)]
    assert bool(all_finite(grads))
    grads[0][-1] = float("nan")
    assert not bool(all_finite(grads)) and first_nonfinite([("g0", grads[0]), ("g1", grads[1])]) == "g0 (nan)"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the multi-tensor kernel of the check")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_on_cuda_every_position_of_every_tensor_is_seen(dtype):
    grads = [torch.zeros(n, dtype=dtype, device="cuda") for n in (1, 7, 65_537, N)]  # across the kernel's chunks
    assert bool(all_finite(grads)) and all_finite(grads).device.type == "cuda"
    for t in grads:
        for i in sorted({0, t.numel() // 2, t.numel() - 1}):
            for value in (float("nan"), float("inf"), float("-inf")):
                t[i] = value
                assert not bool(all_finite(grads)), (t.numel(), i, value)
                t[i] = 0
    assert bool(all_finite([*grads, torch.ones(3)]))  # a CPU tensor beside them: its own group, one answer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_on_the_cpu_finite_values_whose_squares_overflow_are_still_finite(dtype):
    """The CPU's fast path (L2 norms) overflows on huge finite values: their maxima are read again, not reported."""
    big = torch.full((1000,), torch.finfo(dtype).max, dtype=dtype)
    assert not bool(torch.isfinite(torch._foreach_norm([big], 2)[0]))  # the L2 norm alone would call it non-finite
    assert bool(all_finite([big, torch.ones(3, dtype=dtype)]))
    big[17] = float("nan")
    assert not bool(all_finite([big]))


def test_on_the_cpu_a_finite_group_is_read_once_by_its_l2_norms(monkeypatch):
    grads = [torch.randn(64) for _ in range(30)]
    calls: list[float] = []
    real = torch._foreach_norm

    def recording(tensors, ord=2, *args, **kwargs):
        calls.append(float(ord))
        return real(tensors, ord, *args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_norm", recording)
    assert bool(all_finite(grads)) and calls == [2.0]
    grads[7][3] = float("inf")
    calls.clear()
    assert not bool(all_finite(grads)) and calls == [2.0, float("inf")]  # not finite: the maxima decide
