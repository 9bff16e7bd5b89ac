"""Atomic, verified checkpoints and ``ckpt_path=last`` resolution: unit tests and one tiny real Trainer."""
from __future__ import annotations

import os
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_speed.checkpointing import (
    AtomicCheckpointIO,
    CorruptCheckpointError,
    FaultTolerance,
    last_good_checkpoint,
    resolve_ckpt_path,
    verify_checkpoint,
)
from lit_speed.checkpointing.atomic_checkpoint_io import previous_path, write_atomically
from lit_speed.checkpointing.fault_tolerance import classify_failure, nonfinite_parameters
from lit_speed.checkpointing.resume import checkpoint_candidates, rng_state, set_rng_state
from lit_speed.data.digits import DigitsDataModule
from lit_speed.models.mlp import MLPClassifier


def _save(path: Path, value: float, io: AtomicCheckpointIO | None = None) -> None:
    (io or AtomicCheckpointIO()).save_checkpoint({"state_dict": {"w": torch.full((256,), value)}, "step": value}, path)


def _flip_byte_in_tensor_data(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the middle of the file is inside the tensor record here
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_save_keeps_previous_version_and_leaves_no_temporary_files(tmp_path):
    path = tmp_path / "last.ckpt"
    _save(path, 1.0)
    _save(path, 2.0)
    assert torch.load(path, weights_only=True)["step"] == 2.0
    assert torch.load(previous_path(path), weights_only=True)["step"] == 1.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "last.ckpt.prev"]


def test_keep_previous_false_keeps_only_the_file(tmp_path):
    path = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO(keep_previous=False)
    _save(path, 1.0, io)
    _save(path, 2.0, io)
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


@pytest.mark.parametrize("damage", [_flip_byte_in_tensor_data, _truncate], ids=["bit_flip", "truncated"])
def test_verify_finds_damage_that_torch_load_misses_or_reports_badly(tmp_path, damage):
    path = tmp_path / "last.ckpt"
    _save(path, 1.0)
    verify_checkpoint(path)  # intact: passes
    damage(path)
    with pytest.raises(CorruptCheckpointError, match=r"last\.ckpt is unusable: .*Fix: resume with ckpt_path=last"):
        verify_checkpoint(path)
    with pytest.raises(CorruptCheckpointError, match="unusable"):
        AtomicCheckpointIO().load_checkpoint(path)


def test_torch_load_alone_silently_loads_a_bit_flipped_checkpoint(tmp_path):
    # why verify_checkpoint exists: torch.load does not check the archive's CRCs
    path = tmp_path / "last.ckpt"
    _save(path, 1.0)
    _flip_byte_in_tensor_data(path)
    loaded = torch.load(path, weights_only=True)
    assert not torch.equal(loaded["state_dict"]["w"], torch.full((256,), 1.0))


def test_verify_rejects_missing_file_and_empty_folder(tmp_path):
    with pytest.raises(CorruptCheckpointError, match="does not exist"):
        verify_checkpoint(tmp_path / "nope.ckpt")
    (tmp_path / "ds.ckpt").mkdir()
    with pytest.raises(CorruptCheckpointError, match=r"holds no \.pt files"):
        verify_checkpoint(tmp_path / "ds.ckpt")


def test_write_with_failed_verification_leaves_the_old_file(tmp_path):
    path = tmp_path / "last.ckpt"
    _save(path, 1.0)
    with pytest.raises(CorruptCheckpointError):
        write_atomically(b"not a zip archive", path)
    assert torch.load(path, weights_only=True)["step"] == 1.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_last_good_checkpoint_skips_damaged_newer_files(tmp_path):
    path = tmp_path / "last.ckpt"
    _save(path, 1.0)
    time.sleep(0.01)
    _save(path, 2.0)
    assert checkpoint_candidates([tmp_path]) == [path, previous_path(path)]
    assert last_good_checkpoint([tmp_path]) == path
    _truncate(path)
    with pytest.warns(UserWarning, match=r"last\.ckpt is unusable"):
        assert last_good_checkpoint([tmp_path]) == previous_path(path)


def test_last_good_checkpoint_none_for_empty_and_error_when_all_damaged(tmp_path):
    assert last_good_checkpoint([tmp_path, tmp_path / "missing"]) is None
    _save(tmp_path / "last.ckpt", 1.0)
    _truncate(tmp_path / "last.ckpt")
    with pytest.warns(UserWarning), pytest.raises(CorruptCheckpointError,
                                                  match=r"all 1 checkpoint\(s\) are damaged.*ckpt_path=null"):
        last_good_checkpoint([tmp_path])


def test_resolve_explicit_paths_and_lightning_keywords(tmp_path):
    trainer = pl.Trainer(logger=False, callbacks=[ModelCheckpoint(dirpath=tmp_path)], enable_progress_bar=False)
    assert resolve_ckpt_path(None, trainer) is None
    assert resolve_ckpt_path("best", trainer) == "best"
    assert resolve_ckpt_path("last", trainer) is None  # nothing saved yet: a fresh start, not an error
    with pytest.raises(FileNotFoundError, match=r"ckpt_path=.*no such file\. Fix: .*ckpt_path=last"):
        resolve_ckpt_path(str(tmp_path / "missing.ckpt"), trainer)
    _save(tmp_path / "x.ckpt", 1.0)
    assert resolve_ckpt_path(str(tmp_path / "x.ckpt"), trainer) == str(tmp_path / "x.ckpt")
    assert resolve_ckpt_path("last", trainer) == str(tmp_path / "x.ckpt")
    _truncate(tmp_path / "x.ckpt")
    with pytest.raises(CorruptCheckpointError, match="unusable"):
        resolve_ckpt_path(str(tmp_path / "x.ckpt"), trainer)


def test_rng_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    import random

    import numpy as np

    torch.save(rng_state(), tmp_path / "rng.pt")
    expected = (torch.rand(4), np.random.rand(3), random.random())
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert torch.equal(torch.rand(4), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1])
    assert random.random() == expected[2]


@pytest.mark.parametrize("kwargs, match", [
    ({"on_nonfinite_weights": "ignore"}, r"on_nonfinite_weights must be one of \('warn', 'raise'\), got 'ignore'"),
    ({"check_every_n_steps": -1}, r"check_every_n_steps must be an int >= 0 .*got -1\. Fix"),
    ({"check_every_n_steps": 1.5}, r"check_every_n_steps must be an int >= 0 .*got 1\.5"),
])
def test_fault_tolerance_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FaultTolerance(**kwargs)


def test_classify_failure():
    assert classify_failure(MemoryError()) == "out_of_memory"
    assert classify_failure(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried ...")) == "out_of_memory"
    assert classify_failure(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")) == "out_of_memory"
    assert classify_failure(RuntimeError("could not create a primitive")) == "out_of_memory"  # oneDNN
    peer = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:26778")
    assert classify_failure(peer, world_size=2) == "lost_peer"
    assert classify_failure(peer, world_size=1) is None  # one process has no peer to lose
    assert classify_failure(ValueError("bad value")) is None


def test_nonfinite_parameters_names_them():
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    assert nonfinite_parameters(net) == []
    with torch.no_grad():
        net[1].bias[0] = float("inf")
    assert nonfinite_parameters(net) == ["1.bias"]


def _tiny_fit(tmp_path: Path, callbacks: list, max_epochs: int = 2, ckpt_path: str | None = None) -> pl.Trainer:
    pl.seed_everything(0, workers=True)
    model = MLPClassifier(hidden=16, depth=1, optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    trainer = pl.Trainer(accelerator="cpu", max_epochs=max_epochs, limit_train_batches=3, limit_val_batches=1,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, deterministic=True, default_root_dir=tmp_path,
                         callbacks=[ModelCheckpoint(dirpath=tmp_path / "checkpoints", save_last=True), *callbacks])
    trainer.fit(model, datamodule=DigitsDataModule(batch_size=32), ckpt_path=ckpt_path)
    return trainer


def test_fault_tolerance_installs_atomic_io_in_a_real_trainer(tmp_path):
    ft = FaultTolerance()
    trainer = _tiny_fit(tmp_path, [ft])
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    folder = tmp_path / "checkpoints"
    assert (folder / "last.ckpt.prev").exists()  # 2 epochs: the second save kept the first
    assert not [p for p in os.listdir(folder) if ".tmp-" in p]
    for path in checkpoint_candidates([folder]):
        verify_checkpoint(path)
        # the whole training state (with RNG states) loads without unpickling arbitrary code
        ckpt = torch.load(path, weights_only=True)
        assert "rng" in ckpt["callbacks"]["FaultTolerance"]
    assert ft.final_summary()["weights_finite"] is True
    assert ft.final_summary()["checkpoint_io"] == "AtomicCheckpointIO"


def test_a_users_own_checkpoint_io_is_left_alone(tmp_path):
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    class MyIO(TorchCheckpointIO):
        pass

    pl.seed_everything(0)
    trainer = pl.Trainer(accelerator="cpu", plugins=[MyIO()], callbacks=[FaultTolerance()], logger=False,
                         max_steps=1, limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path)
    trainer.fit(MLPClassifier(hidden=8, depth=1, optimizer=lambda p: torch.optim.SGD(p, lr=0.1)),
                datamodule=DigitsDataModule(batch_size=32))
    assert type(trainer.strategy.checkpoint_io) is MyIO


def test_a_deepspeed_folder_is_as_new_as_the_newest_file_inside_it(tmp_path):
    # DeepSpeed rewrites last.ckpt/checkpoint/*.pt in place: the folder's own mtime stays old
    old, new = tmp_path / "best.ckpt", tmp_path / "last.ckpt"
    for folder in (new, old):
        (folder / "checkpoint").mkdir(parents=True)
    torch.save({"w": torch.ones(2)}, new / "checkpoint" / "mp_rank_00_model_states.pt")
    time.sleep(0.02)
    torch.save({"w": torch.ones(2)}, old / "checkpoint" / "mp_rank_00_model_states.pt")
    time.sleep(0.02)
    torch.save({"w": torch.zeros(2)}, new / "checkpoint" / "mp_rank_00_model_states.pt")  # rewritten in place
    assert checkpoint_candidates([tmp_path]) == [new, old]
    assert last_good_checkpoint([tmp_path]) == new


def test_rng_states_of_another_world_size_fall_back_to_rank_0s_with_a_warning():
    torch.manual_seed(1)
    rank0 = rng_state()
    torch.manual_seed(2)
    rank1 = rng_state()
    ft = FaultTolerance()  # never set up: a single process
    with pytest.warns(UserWarning, match=r"RNG states for 2 process\(es\), this run has 1: every process gets rank 0's"):
        ft.load_state_dict({"rng": rank0, "rng_per_rank": [rank0, rank1]})
    assert torch.equal(torch.get_rng_state(), rank0["torch"])
    ft.load_state_dict({"rng": rank1})  # a single-process checkpoint: no warning, its state
    assert torch.equal(torch.get_rng_state(), rank1["torch"])
