"""Mid-epoch kill and resume of the built-in workloads ends bitwise where the uninterrupted run ends.

One charlm epoch is thousands of steps, so every charlm checkpoint is mid-epoch. Before, the loader was a
``RandomSampler``: the resumed run drew a new shuffle, Lightning warned that the loader "is not resumable",
and the final weights differed (up to 0.048). The training order of digits and charlm now saves its epoch
seed and how many batches training used (:class:`lit_speed.data.resumable.ResumableShuffleSampler`).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.fault_scripts.compare_checkpoints import assert_bitwise_equal
from tests.helpers.fault_scripts.runs import explain, kill_at, train

SIGKILLED = -9
# charlm_cpu shrunk: 16 steps, a checkpoint (last.ckpt) at every validation (every 4 steps), all mid-epoch
CHARLM = ["experiment=charlm_cpu", "trainer.max_steps=16", "trainer.val_check_interval=4", "trainer.limit_val_batches=1",
          "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "data.max_val_windows=16",
          "trainer.num_sanity_val_steps=0", "trainer.deterministic=true", "seed=7",
          "callbacks=[model_checkpoint,fault_tolerance]", "logger=none", "validate=false",
          "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


def _assert_bitwise_equal(reference: Path, resumed: Path) -> None:
    compared = assert_bitwise_equal(reference, resumed)
    assert any(k.startswith("/optimizer") for k in compared) and any(k.startswith("/weights") for k in compared)


@pytest.mark.slow  # ~30 s: three charlm runs
@pytest.mark.parametrize("workers", [0, 1], ids=["no-workers", "1-worker"])
def test_charlm_killed_after_a_mid_epoch_checkpoint_resumes_bitwise(tmp_path, workers):
    args = CHARLM + [f"data.num_workers={workers}"]
    reference = train(args, tmp_path / "reference")
    assert reference.returncode == 0, explain(reference)
    killed = train(args + kill_at(10), tmp_path / "run")  # last.ckpt = step 8, mid-epoch
    assert killed.returncode == SIGKILLED, explain(killed)
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 8
    resumed = train(args + ["ckpt_path=last"], tmp_path / "run")
    assert resumed.returncode == 0, explain(resumed)
    _assert_bitwise_equal(tmp_path / "reference" / "checkpoints" / "last.ckpt", last)
    assert "charlm training order resumed at epoch 0, batch 8" in resumed.stdout + resumed.stderr, explain(resumed)


def test_resumable_sampler_draws_like_shuffle_true_and_goes_on_where_training_stopped():
    from torch.utils.data import BatchSampler, RandomSampler

    from lit_speed.data.resumable import ResumableShuffleSampler

    torch.manual_seed(0)
    plain = list(BatchSampler(RandomSampler(range(50)), 8, drop_last=True))
    torch.manual_seed(0)
    sampler = ResumableShuffleSampler(50, 8, drop_last=True)
    batches = list(sampler)
    assert batches == plain and len(sampler) == 6  # an uninterrupted run serves what shuffle=True serves
    for _ in range(4):
        sampler.mark_used()
    fresh = ResumableShuffleSampler(50, 8, drop_last=True)
    fresh.load_state_dict({**sampler.state_dict(), "epoch_done": False})
    torch.manual_seed(123)  # the resumed process's RNG is elsewhere: it must not matter
    assert list(fresh) == batches[4:] == list(fresh)  # rebuilding the iterator before training resumes is harmless
    fresh.set_epoch(1)
    assert list(fresh) != batches  # the next epoch draws a new shuffle
    done = ResumableShuffleSampler(50, 8, drop_last=True)
    done.load_state_dict({**sampler.state_dict(), "epoch_done": True})
    assert len(list(done)) == 6  # saved at an epoch's end: a whole new epoch


def test_resumable_sampler_shards_are_disjoint_across_ranks():
    from lit_speed.data.resumable import ResumableShuffleSampler

    shards = []
    for rank in range(2):
        torch.manual_seed(0)
        shards.append(sum(ResumableShuffleSampler(9, 2, rank=rank, world_size=2), []))
    assert len(shards[0]) == len(shards[1]) == 5 and sorted(shards[0] + shards[1]) == sorted(list(range(9)) + [shards[0][0]])


@pytest.mark.parametrize("drop_last", [False, True])
def test_resumable_sampler_on_two_ranks_serves_what_lightnings_distributed_sampler_serves(drop_last):
    # plain DDP with shuffle=True: Lightning injects DistributedSampler(seed=PL_GLOBAL_SEED) and keeps the batch
    # size and drop_last in a new BatchSampler; the resumable sampler must serve the very same batches
    from torch.utils.data import BatchSampler, DistributedSampler

    from lit_speed.data.resumable import ResumableShuffleSampler

    for rank in range(2):
        ours = ResumableShuffleSampler(23, 4, drop_last, rank=rank, world_size=2, seed=7)
        plain = DistributedSampler(range(23), num_replicas=2, rank=rank, shuffle=True, seed=7)
        for epoch in range(3):
            ours.set_epoch(epoch)
            plain.set_epoch(epoch)
            torch.manual_seed(epoch)  # the global RNG plays no part on several ranks
            assert list(ours) == list(BatchSampler(plain, 4, drop_last))


def test_resumable_sampler_on_two_ranks_resumes_mid_epoch():
    from lit_speed.data.resumable import ResumableShuffleSampler

    sampler = ResumableShuffleSampler(23, 4, rank=1, world_size=2, seed=7)
    sampler.set_epoch(2)
    epoch = list(sampler)
    sampler.used_in_epoch = 1  # training used one batch, then the run was killed
    resumed = ResumableShuffleSampler(23, 4, rank=1, world_size=2, seed=7)
    resumed.load_state_dict(sampler.state_dict())
    assert list(resumed) == epoch[1:]
