"""LiveTensorTracker counts allocations exactly: sizes derived from shapes and dtypes."""
from __future__ import annotations

import torch

from lit_speed.memory.memory_tracker import LiveTensorTracker, tensor_bytes


def test_counts_new_storage_not_views_and_uncounts_frees():
    x = torch.ones(1000)  # created outside: not counted
    with LiveTensorTracker() as tracker:
        a = x * 2                        # new float32 storage: 4000 bytes
        v = a.view(10, 100).t()          # view: shares a's storage
        a.add_(1)                        # in-place: no new storage
        assert tracker.current_bytes == 1000 * 4
        b = torch.zeros(500, dtype=torch.float64)  # 4000 bytes
        assert tracker.current_bytes == 8000
        del a, v
        c = b + 1                        # a's storage is gone by now; c adds 4000
        assert tracker.current_bytes == 8000
    assert tracker.peak_bytes == 8000
    assert c.numel() == 500


def test_reset_peak_and_backward_counted():
    w = torch.randn(64, 64, requires_grad=True)
    with LiveTensorTracker() as tracker:
        y = (torch.randn(32, 64) @ w).relu().sum()
        tracker.reset_peak()
        y.backward()
    assert w.grad is not None
    assert tracker.peak_bytes >= tensor_bytes(w.grad)  # the gradient was allocated inside backward


def test_tensor_bytes_counts_shared_storage_once():
    t = torch.zeros(10, 10)
    assert tensor_bytes([t, t[0], {"k": t.t()}]) == 400


def test_skip_matmuls_allocates_what_the_products_allocate_and_computes_none():
    from lit_speed.memory.memory_tracker import SkipMatmuls

    a, b = torch.ones(8, 5), torch.ones(5, 3)
    bias, batch_a, batch_b = torch.ones(3), torch.ones(2, 8, 5), torch.ones(2, 5, 3, dtype=torch.float32)

    def products():
        out = torch.empty(8, 3)
        torch.mm(a, b, out=out)  # into a given tensor: nothing new
        acc = torch.ones(8, 3)
        acc.addmm_(a, b)         # in place
        return [a @ b, torch.addmm(bias, a, b), torch.bmm(batch_a, batch_b), torch.baddbmm(batch_b[:, :1], batch_a,
                batch_b), out, acc]

    with LiveTensorTracker() as real:
        expected = products()
    with LiveTensorTracker() as skipped, SkipMatmuls():
        got = products()
    assert skipped.peak_bytes == real.peak_bytes > 0
    for e, g in zip(expected, got):
        assert g.shape == e.shape and g.dtype == e.dtype and g.stride() == e.stride()
    assert all(g.abs().sum() == 0 for g in got[:4]) and got[5].eq(1).all()  # nothing was computed (ones @ ones != 0)
    assert expected[0].eq(5).all()


def test_skip_matmuls_skips_large_floating_casts_only_and_counts_their_bytes():
    """A weight's ``.to(bf16)`` in a probe (the LM head at the real vocabulary, re-cast per chunk) returns zeros of the
    cast's shape and dtype; the bytes counted are the real cast's. Small casts, integer ones and copies to another
    dtype kind are computed: their values may steer what follows (indices, masks)."""
    from lit_speed.memory.memory_tracker import SKIPPED_CAST_ELEMENTS, SkipMatmuls

    big = torch.ones(SKIPPED_CAST_ELEMENTS // 32, 64)  # twice the threshold: its half (a slice) is skipped too
    small, ids = torch.ones(4, 4), torch.arange(6)

    def casts():
        return [big.to(torch.bfloat16), big[: big.shape[0] // 2].to(torch.float16), small.to(torch.bfloat16),
                ids.to(torch.float32), big.to(torch.int32)[:1], big.to(torch.float32), big.t().to(torch.bfloat16)]

    with LiveTensorTracker() as real:
        expected = casts()
    with LiveTensorTracker() as skipped, SkipMatmuls():
        got = casts()
    assert skipped.peak_bytes == real.peak_bytes > big.numel() * 2
    for e, g in zip(expected, got):
        assert g.shape == e.shape and g.dtype == e.dtype and g.stride() == e.stride()  # a transposed weight's too
    assert got[0].eq(0).all() and got[1].eq(0).all() and got[6].eq(0).all()  # skipped: zeros, not the ones cast
    assert got[2].eq(1).all() and got[3].equal(ids.float()) and got[4].eq(1).all()  # computed
    assert got[5] is big  # a cast to its own dtype is no copy: nothing to skip
