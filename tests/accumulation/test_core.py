"""Functional core of the accumulation scheduler: schedules, item counting, normalisation, OOM, micro-batch."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lit_speed.accumulation import micro_batch as mb
from lit_speed.accumulation.schedule import (
    check_divisible,
    factor_at,
    factor_for_effective_batch,
    lr_scale,
    schedule_plan,
    validate_schedule,
    value_at,
)
from lit_speed.accumulation.window import (
    count_items,
    count_tokens,
    head_batch,
    scale_gradients,
    split_batch,
    window_scale,
)
from lit_speed.oom import is_oom_error


def test_validate_schedule_copies_and_accepts_a_valid_schedule():
    given = {0: 1, 200: 4, 1000: 8}
    out = validate_schedule(given, "accumulation.factors")
    assert out == given and out is not given
    # the list form Hydra overrides replace instead of merging into the YAML default
    assert validate_schedule([[0, 1], [200, 4], [1000, 8]], "accumulation.factors") == given


@pytest.mark.parametrize("schedule, match", [
    ({0: 1, 5: 2, 3: 4}, r"keys must be strictly increasing, got \[0, 5, 3\]"),
    ({0: 1, 4: 0}, r"every factor must be >= 1, got \[1, 0\]"),
    ({2: 4}, r"must start at position 0"),
    ({}, r"must not be empty"),
    ({0: 1.5}, r"must be integers"),
    ([[0, 1], [0, 2]], r"keys must be strictly increasing, got \[0, 0\]"),
    ([[0, 1, 2]], r"as a list must hold \[position, value\] pairs"),
])
def test_validate_schedule_errors_name_the_setting(schedule, match):
    with pytest.raises(ValueError, match=match):
        validate_schedule(schedule, "accumulation.factors")


def test_step_lookup_changes_exactly_at_the_key():
    sched = {0: 1, 200: 4, 1000: 8}
    assert [factor_at(sched, s) for s in (0, 199, 200, 999, 1000, 10**6)] == [1, 1, 4, 4, 8, 8]


def test_linear_ramp_interpolates_and_rounds_down():
    sched = {0: 8, 100: 32}
    assert value_at(sched, 50, "linear") == 20.0
    assert value_at(sched, 150, "linear") == 32.0
    assert factor_at({0: 1, 10: 4}, 5, "linear") == 2  # 2.5 -> 2
    # 20 samples with micro 4 on 2 processes: 2 micro-batches each (16 <= 20 < 24)
    assert factor_for_effective_batch(20, 4, 2) == 2
    assert factor_for_effective_batch(3, 4, 2) == 1  # never below one micro-batch


def test_divisibility_error_suggests_neighbours():
    with pytest.raises(ValueError, match=r"effective_batch\[100\] = 30 is not divisible by micro_batch \(8\) x "
                                         r"world size \(1\) = 8; use 24 or 32"):
        check_divisible({0: 16, 100: 30}, 8, 1, "accumulation.effective_batch")
    check_divisible({0: 16, 100: 32}, 8, 2, "accumulation.effective_batch")


def test_lr_scale_rules():
    assert lr_scale(128, 32, "none") == 1.0
    assert lr_scale(128, 32, "linear") == 4.0
    assert lr_scale(128, 32, "sqrt") == 2.0


def test_count_items_samples_tokens_and_micro_batches():
    x = torch.zeros(3, 5, dtype=torch.long)
    y = torch.tensor([[1, 2, -100, -100, -100], [1, 1, 1, 1, 1], [-100] * 5])
    assert count_items((x, y), "samples") == 3
    assert count_items((x, y), "tokens") == 7
    assert count_items({"input_ids": x, "labels": y}, "tokens") == 7
    assert count_items((x, y), "micro_batch") == 1
    assert count_tokens((x, y)) == 7  # padding (ignore_index) is not a token
    assert count_tokens((x, y), ignore_index=1) == 9
    with pytest.raises(ValueError, match=r"normalize='tokens' needs the targets in batch\[labels"):
        count_items({"input_ids": x}, "tokens")
    with pytest.raises(ValueError, match=r"got a torch.float32 target tensor; use normalize='samples'"):
        count_items((x, y.float()), "tokens")


def test_split_and_head_keep_structure():
    batch = {"x": torch.arange(8).view(4, 2), "y": torch.arange(4)}
    halves = split_batch(batch, 2)
    assert [h["y"].tolist() for h in halves] == [[0, 1], [2, 3]]
    assert head_batch((batch["x"], batch["y"]), 3)[1].tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="cannot split a micro-batch of 4 samples into 8 parts"):
        split_batch(batch, 8)


def test_summed_micro_batch_losses_over_items_equal_the_window_mean():
    """The normalisation identity the callback relies on, on raw autograd (no Lightning)."""
    torch.manual_seed(0)
    w = torch.randn(6, 5, requires_grad=True)
    x, y = torch.randn(10, 6), torch.randint(0, 5, (10,))
    y[[1, 4, 7]] = -100
    F.cross_entropy(x @ w, y, ignore_index=-100).backward()
    expected = w.grad.clone()
    w.grad = None
    items = 0
    for xs, ys in zip(x.split([2, 5, 3]), y.split([2, 5, 3])):  # ragged micro-batches
        n = count_items((xs, ys), "tokens")
        (F.cross_entropy(xs @ w, ys, ignore_index=-100) * n).backward()
        items += n
    scale_gradients([w], window_scale(items, world_size=1))
    assert torch.allclose(w.grad, expected, rtol=1e-6, atol=1e-7)


def test_window_scale_undoes_ddp_averaging_and_refuses_empty_windows():
    assert window_scale(64, 2) == 2 / 64
    with pytest.raises(ValueError, match="held 0 items"):
        window_scale(0, 1)


@pytest.mark.parametrize("error, expected", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"), True),
    (RuntimeError("CUDA error: out of memory"), True),
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
    (RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input."), True),
    (RuntimeError("cuFFT error: CUFFT_ALLOC_FAILED"), True),
    (RuntimeError("MPS backend out of memory (MPS allocated: 1.2 GB)"), True),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:114] data. DefaultCPUAllocator: can't allocate memory"), True),
    (RuntimeError("could not create a primitive"), True),  # oneDNN under RLIMIT_AS
    (RuntimeError("std::bad_alloc"), True),
    (MemoryError(), True),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"), False),
    (ValueError("out of memory"), False),
])
def test_is_oom_error_recognises_every_variant(error, expected):
    assert is_oom_error(error) is expected


def test_saved_activation_bytes_grow_linearly_with_the_batch():
    layer = torch.nn.Linear(64, 256)
    per_sample, fixed = mb.measure_activation_model(lambda b: torch.tanh(layer(b)).sum(), torch.randn(8, 64),
                                                    head_batch)
    # Linear saves its input (64 floats), tanh saves its output (256 floats): 320 * 4 bytes per sample
    assert per_sample == 320 * 4
    assert fixed == 0


def test_pick_micro_batch_takes_the_largest_that_fits():
    cands = mb.divisor_candidates(32)
    assert cands == [1, 2, 4, 8, 16, 32]
    assert mb.pick_micro_batch(100.0, 50.0, 50 + 8.5 * 100, cands) == 8
    with pytest.raises(ValueError, match=r"memory_budget_mb = 0.0 is too small: micro-batch 1 needs"):
        mb.pick_micro_batch(100.0, 50.0, 10.0, cands)
    assert math.isclose(mb.pick_micro_batch(1.0, 0.0, 1e9, cands), 32)


def test_schedule_plan_says_the_factor_at_the_start_the_largest_and_where_it_goes():
    # issue 33: the start-up table said "x1" while a ramp started at 64 samples (x8 at micro-batch 8)
    assert schedule_plan({0: 64, 50: 256}, False, "step", "linear", 8, 1) == (
        8, 32, "rising linearly (whole micro-batches) to 256 (x32) at step 50")
    assert schedule_plan({0: 1, 200: 4}, True, "step", "step", 16, 2) == (1, 4, "then x4 = 128 at step 200")
    assert schedule_plan({0: 4}, True, "epoch", "step", 16, 1) == (4, 4, "")
    assert schedule_plan({0: 32, 10_000: 64}, False, "samples", "step", 16, 1) == (
        2, 4, "then 64 (x4) after 10,000 samples")
    assert schedule_plan({0: 64}, False, "step", "linear", None, 1)[2].endswith("the micro-batch is chosen at setup")


@pytest.mark.parametrize("ramp", ["step", "linear"])
def test_schedule_plan_refuses_an_effective_batch_the_micro_batch_does_not_divide(ramp):
    # (a linear ramp of [[0, 100]] at micro-batch 64 trained at 64 without a word)
    with pytest.raises(ValueError, match=r"effective_batch\[0\] = 100 is not divisible by micro_batch \(64\) x world "
                                         r"size \(1\) = 64; use 64 or 128"):
        schedule_plan({0: 100}, False, "step", ramp, 64, 1)


def test_an_effective_batch_below_one_micro_batch_names_the_one_value_that_works():
    # charlm_fast's 12 at digits' micro-batch 64 once read "use 64 or 64"
    with pytest.raises(ValueError, match=r"effective_batch\[0\] = 12 is not divisible by micro_batch \(64\) x world "
                                         r"size \(1\) = 64; use 64, or change the micro-batch"):
        schedule_plan({0: 12, 200: 24}, False, "step", "step", 64, 1)
