"""Functional core of the curriculum: pacing functions, difficulty order, sharding and the sampler walk."""
import math

import pytest
import torch
from torch.utils.data import TensorDataset

from lit_speed.curriculum.difficulty import centroid_scores, difficulty_order, loss_scores, resolve_scores
from lit_speed.curriculum.pacing import allowed_count, pacing_fraction, seq_len_at
from lit_speed.curriculum.sampler import CurriculumSampler, epoch_permutation, shard_of_allowed

A = 0.2  # start fraction used in the exact-value table below


@pytest.mark.parametrize("kind, middle", [
    ("linear", A + (1 - A) * 0.5),
    ("root", math.sqrt(A * A + (1 - A * A) * 0.5)),
    ("step", A + (1 - A) * 2 / 4),  # 4 stages: floor(0.5 * 4) / 4
    ("exponential", A ** 0.5),
    ("none", 1.0),
])
def test_pacing_exact_values_at_start_middle_end(kind, middle):
    assert pacing_fraction(kind, 0.0, A) == pytest.approx(1.0 if kind == "none" else A)
    assert pacing_fraction(kind, 0.5, A) == pytest.approx(middle)
    assert pacing_fraction(kind, 1.0, A) == 1.0
    assert pacing_fraction(kind, 7.0, A) == 1.0  # past the end: the full set


@pytest.mark.parametrize("kind", ["linear", "root", "step", "exponential"])
def test_pacing_is_monotone_and_below_one_before_the_end(kind):
    values = [pacing_fraction(kind, p / 100, A) for p in range(101)]
    assert all(b >= a for a, b in zip(values, values[1:]))
    assert max(values[:-1]) < 1.0 and values[-1] == 1.0


def test_step_pacing_jumps_at_stage_boundaries():
    assert pacing_fraction("step", 0.249, 0.2, stages=4) == pytest.approx(0.2)
    assert pacing_fraction("step", 0.25, 0.2, stages=4) == pytest.approx(0.4)


def test_pacing_errors_name_the_setting():
    with pytest.raises(ValueError, match=r"pacing must be one of .*got 'cosine'"):
        pacing_fraction("cosine", 0.5, 0.2)
    with pytest.raises(ValueError, match=r"start_fraction must be in \(0, 1\], got 0"):
        pacing_fraction("linear", 0.5, 0.0)
    with pytest.raises(ValueError, match="pace_stages must be >= 1"):
        pacing_fraction("step", 0.5, 0.2, stages=0)
    with pytest.raises(ValueError, match="the training set is empty"):
        allowed_count(0, 0.5)


def test_allowed_count_rounds_up_and_respects_minimum():
    assert allowed_count(10, 0.3) == 3  # not 4 from 0.30000000000000004 * 10
    assert allowed_count(10, 0.31) == 4
    assert allowed_count(10, 0.01, minimum=2) == 2
    assert allowed_count(10, 1.0) == 10


def test_seq_len_warmup_ramp():
    assert seq_len_at(0, 16, 64, 100) == 16
    assert seq_len_at(50, 16, 64, 100) == 40  # 16 + 48 * 0.5 = 40, a multiple of 8
    assert seq_len_at(51, 16, 64, 100) == 40  # 40.48 rounds down to the multiple
    assert seq_len_at(99, 16, 64, 100) == 56
    assert seq_len_at(100, 16, 64, 100) == 64
    with pytest.raises(ValueError, match=r"seq_len_start must be in \[1, block_size=64\], got 80"):
        seq_len_at(0, 80, 64, 10)
    with pytest.raises(ValueError, match="seq_len_multiple must be >= 1"):
        seq_len_at(0, 8, 64, 10, multiple=0)


def test_difficulty_order_is_easiest_first_with_seeded_ties():
    scores = torch.tensor([3.0, 1.0, 2.0, 1.0])
    order = difficulty_order(scores, 4, seed=0)
    assert scores[order].tolist() == sorted(scores.tolist())
    assert difficulty_order(scores, 4, seed=0).tolist() == order.tolist()
    assert sorted(difficulty_order(None, 50, seed=1).tolist()) == list(range(50))
    with pytest.raises(ValueError, match="NaN or inf"):
        difficulty_order(torch.tensor([1.0, float("nan")]), 2)


def test_centroid_scores_rank_typical_samples_first():
    x = torch.tensor([[0.0], [0.1], [5.0], [10.0], [10.1], [4.0]])
    y = torch.tensor([0, 0, 0, 1, 1, 1])
    scores = centroid_scores(TensorDataset(x, y))
    # class 0 mean 1.7: the outlier 5.0 is hardest; class 1 mean 8.03: 4.0 is hardest
    assert scores.argmax().item() == 5 and scores[2] > scores[0]


def test_loss_scores_and_resolve_errors():
    ds = TensorDataset(torch.eye(3), torch.tensor([0, 1, 2]))
    model = torch.nn.Linear(3, 3, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.diag(torch.tensor([5.0, 0.0, -5.0])))
    scores = loss_scores(model, ds)
    assert scores[0] < scores[1] < scores[2]  # the model is confident on 0, unsure on 1, wrong on 2
    with pytest.raises(ValueError, match="difficulty='loss' needs reference_model="):
        resolve_scores("loss", ds)
    with pytest.raises(ValueError, match="difficulty must be one of"):
        resolve_scores("entropy", ds)
    with pytest.raises(ValueError, match="difficulty has 2 scores but the training set has 3 samples"):
        resolve_scores([1.0, 2.0], ds)
    assert resolve_scores(lambda s: float(s[1]), ds).tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_shards_are_disjoint_and_cover_the_allowed_set(world):
    order = torch.randperm(101, generator=torch.Generator().manual_seed(3))
    perm = epoch_permutation(101, seed=5, epoch=2)
    for n in (world, 37, 101):
        shards = [shard_of_allowed(order, n, perm, r, world) for r in range(world)]
        flat = torch.cat(shards).tolist()
        assert len(flat) == len(set(flat)) == n  # disjoint, and together exactly the allowed count
        assert set(flat) == set(order[:n].tolist())
        assert max(map(len, shards)) - min(map(len, shards)) <= 1


def _linear(duration, start=0.25):
    return lambda g: pacing_fraction("linear", g / duration, start)


def test_sampler_yields_only_allowed_indices_and_reaches_full_set_on_schedule():
    n, bs, duration = 100, 8, 20
    order = difficulty_order(torch.arange(n, dtype=torch.float), n)  # index i has difficulty i
    sampler = CurriculumSampler(order, bs, _linear(duration), seed=0)
    assert sampler.n_allowed(duration - 1) < n and sampler.n_allowed(duration) == n
    g = 0
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for batch in sampler:
            assert max(batch) < sampler.n_allowed(g), f"batch {g} used a sample beyond the allowed set"
            sampler.mark_consumed()
            g += 1
    assert g == 3 * math.ceil(n / bs)
    # once the full set is allowed, an epoch is a plain shuffle: every sample exactly once
    sampler.set_epoch(3)
    seen = [i for batch in sampler for i in batch]
    assert sorted(seen) == list(range(n))


def test_sampler_is_deterministic_and_epochs_differ():
    order = torch.arange(64)
    a = CurriculumSampler(order, 8, _linear(4), seed=7)
    b = CurriculumSampler(order, 8, _linear(4), seed=7)
    assert list(a) == list(b)
    a.set_epoch(1)
    b.set_epoch(1)
    first = list(a)
    assert first == list(b)
    a.set_epoch(2)
    assert list(a) != first


def test_sampler_resumes_mid_epoch_from_its_state():
    order = torch.randperm(50, generator=torch.Generator().manual_seed(0))
    ref = CurriculumSampler(order, 4, _linear(10), seed=1)
    ref.set_epoch(1)
    full = list(ref)
    run = CurriculumSampler(order, 4, _linear(10), seed=1)
    run.load_state_dict({"epoch": 1, "batch_in_epoch": 5, "batches_total": 13 + 5})
    ref.load_state_dict({"epoch": 1, "batch_in_epoch": 0, "batches_total": 13})
    assert list(run) == list(ref)[5:]
    assert full != list(ref)  # pacing at global batch 13.. differs from a fresh epoch at batch 0


def test_ddp_ranks_get_disjoint_batches_of_equal_count():
    order = torch.arange(90)
    samplers = [CurriculumSampler(order, 5, _linear(6), seed=2, rank=r, world_size=2) for r in range(2)]
    batches = [list(s) for s in samplers]
    assert len(batches[0]) == len(batches[1]) == math.ceil(45 / 5)
    for b0, b1 in zip(*batches):
        assert not set(b0) & set(b1)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\), got 2"):
        CurriculumSampler(order, 5, _linear(6), rank=2, world_size=2)
