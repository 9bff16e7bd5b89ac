"""ZeroStrategy through a real Trainer on CPU, one process: equivalence, accumulation, errors, checkpoints."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from lit_speed.optim.schedules import warmup_cosine  # noqa: E402
from lit_speed.strategies.consolidate import consolidate_zero_checkpoint  # noqa: E402
from lit_speed.strategies.zero_strategy import ZeroStrategy  # noqa: E402
from tests.helpers.zero import clean_env, make_run, make_trainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# fp32 on both sides; ZeRO steps AdamW on one flat fp32 buffer instead of per-parameter tensors, which may
# change the last bits of a sum, never more: 1e-5 relative is ~100x float32 epsilon on losses around 4.
LOSS_RTOL = 1e-5


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("charlm")


def _fit(cache: Path, strategy, steps: int = 4, batch: int = 8, optimizer: str = "adamw", **kwargs):
    dm, model = make_run(cache, batch, optimizer)
    trainer = make_trainer(strategy, max_steps=steps, **kwargs)
    trainer.fit(model, dm)
    return trainer, model


@pytest.mark.parametrize("stage", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
def test_zero_matches_the_single_process_run(cache: Path, stage: int) -> None:
    # the reference is plain DDP on one process: it re-seeds at setup as ZeroStrategy does, so the data order
    # is identical and any difference comes from ZeRO itself
    _, reference = _fit(cache, "ddp")
    trainer, zero = _fit(cache, ZeroStrategy(stage=stage))
    assert trainer.global_step == 4
    assert zero.losses == pytest.approx(reference.losses, rel=LOSS_RTOL)
    assert zero.losses[-1] < zero.losses[0]  # and it learns


class _SwitchAccumulation(pl.Callback):
    """Change ``trainer.accumulate_grad_batches`` mid-run, as an accumulation schedule does."""

    def on_train_batch_start(self, trainer: "pl.Trainer", *args) -> None:
        trainer.accumulate_grad_batches = 1 if trainer.global_step < 2 else 2


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in module.state_dict().items()}


def test_accumulation_equals_the_large_batch_and_can_change_mid_run(cache: Path) -> None:
    # SGD, not Adam: Adam is blind to a constant gradient scale, so it would hide a double loss division
    _, large = _fit(cache, ZeroStrategy(stage=2), steps=3, batch=8, optimizer="sgd")
    trainer, accumulated = _fit(cache, ZeroStrategy(stage=2), steps=3, batch=4, optimizer="sgd",
                                accumulate_grad_batches=2)
    assert trainer.strategy.deepspeed_engine.gradient_accumulation_steps() == 2
    for key, value in _weights(large).items():
        torch.testing.assert_close(_weights(accumulated)[key], value, rtol=1e-5, atol=1e-6)
    # a callback switches 1 -> 2 after two optimizer steps: ZeRO must follow it exactly as plain DDP does
    _, ddp = _fit(cache, "ddp", steps=4, batch=4, optimizer="sgd", callbacks=[_SwitchAccumulation()])
    trainer, zero = _fit(cache, ZeroStrategy(stage=2), steps=4, batch=4, optimizer="sgd",
                         callbacks=[_SwitchAccumulation()])
    assert len(zero.losses) == len(ddp.losses) == 6  # 2 steps x 1 micro-batch + 2 steps x 2
    assert trainer.strategy.deepspeed_engine.gradient_accumulation_steps() == 2
    for key, value in _weights(ddp).items():
        torch.testing.assert_close(_weights(zero)[key], value, rtol=1e-5, atol=1e-6)


def test_fp16_on_cpu_is_refused_before_training(cache: Path) -> None:
    dm, model = make_run(cache)
    trainer = make_trainer(ZeroStrategy(stage=2), precision="16-mixed")
    with pytest.raises(ValueError, match=r"precision='16-mixed' is not supported by DeepSpeed on the CPU"):
        trainer.fit(model, dm)
    assert model.losses == []


def test_offload_with_a_torch_optimizer_is_refused_naming_cpu_adam(cache: Path) -> None:
    dm, model = make_run(cache)
    trainer = make_trainer(ZeroStrategy(stage=2, offload_optimizer=True))
    with pytest.raises(ValueError, match=r"got AdamW\. Use DeepSpeedCPUAdam: Hydra override `optimizer=cpu_adam`"):
        trainer.fit(model, dm)
    assert model.losses == []


def _scheduled_run(cache: Path, steps: int, **kwargs):
    dm, model = make_run(cache, train_windows=32)  # 4 batches of 8 per epoch
    model.scheduler_factory = functools.partial(warmup_cosine, warmup_steps=2, min_lr_ratio=0.1)
    trainer = make_trainer(ZeroStrategy(stage=2), max_steps=steps, **kwargs)
    return dm, model, trainer


def test_resume_continues_the_trajectory_and_consolidates(cache: Path, tmp_path: Path) -> None:
    # uninterrupted: two 4-batch epochs with a warm-up + cosine LR schedule, checkpoint folder after step 4
    # (a plain DataLoader restarts its epoch on resume, so the checkpoint sits on an epoch boundary)
    ckpt_cb = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_train_steps=4)
    dm, full, trainer = _scheduled_run(cache, 8, callbacks=[ckpt_cb])
    trainer.fit(full, dm)
    step4 = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
    assert step4.is_dir(), sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    # "killed" after step 4: a fresh process state resumes from the folder (weights, AdamW moments, LR schedule)
    dm, resumed, trainer2 = _scheduled_run(cache, 8)
    trainer2.fit(resumed, dm, ckpt_path=str(step4))
    assert trainer2.global_step == 8
    assert resumed.losses == pytest.approx(full.losses[4:], rel=LOSS_RTOL)
    assert trainer2.lr_scheduler_configs[0].scheduler.last_epoch == 8

    # consolidation: one fp32 file with the engine's weights, loadable by plain Lightning
    trainer2.save_checkpoint(tmp_path / "final")
    engine_weights = _weights(resumed)
    out = consolidate_zero_checkpoint(tmp_path / "final", tmp_path / "model.ckpt")
    state = torch.load(out, map_location="cpu", weights_only=False)["state_dict"]
    assert set(state) == set(engine_weights)
    for key, value in engine_weights.items():
        assert state[key].dtype == torch.float32
        torch.testing.assert_close(state[key], value, rtol=0, atol=0)
    plain = type(resumed).load_from_checkpoint(out, optimizer=None)
    x = torch.randint(0, 97, (2, 16))
    torch.testing.assert_close(plain(x), resumed(x))


@pytest.mark.slow  # two extra Python processes (~30 s on a loaded 2-core machine)
def test_consolidate_script_and_its_error(cache: Path, tmp_path: Path) -> None:
    trainer, model = _fit(cache, ZeroStrategy(stage=1), steps=2)
    trainer.save_checkpoint(tmp_path / "ds")
    script = [sys.executable, str(ROOT / "scripts" / "consolidate.py")]
    done = subprocess.run(script + [str(tmp_path / "ds"), str(tmp_path / "one.ckpt")], capture_output=True, text=True,
                          env=clean_env())
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout and (tmp_path / "one.ckpt").is_file()
    # a process without DeepSpeed reads it
    check = ("import sys, torch; from lit_speed.models.gpt import GPTModule; "
             "m = GPTModule.load_from_checkpoint(sys.argv[1]); assert 'deepspeed' not in sys.modules; print('ok')")
    done = subprocess.run([sys.executable, "-c", check, str(tmp_path / "one.ckpt")],
                          capture_output=True, text=True, env=clean_env())
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr
    bad = subprocess.run(script + [str(tmp_path), str(tmp_path / "x.ckpt")], capture_output=True, text=True,
                         env=clean_env())
    assert bad.returncode == 2 and "is not a DeepSpeed ZeRO checkpoint folder" in bad.stderr


@pytest.mark.slow  # constructs DeepSpeedCPUAdam: a ~2 min JIT build on a cold cache
def test_cpu_adam_survives_lightnings_optimizer_wrapper(cache: Path, tmp_path: Path) -> None:
    # plain DeepSpeedCPUAdam segfaults here: Lightning's wrapper runs its __del__ and frees the C++ state.
    # A subprocess, so a regression fails this test instead of killing pytest.
    cmd = [sys.executable, str(ROOT / "tests" / "helpers" / "zero.py"), "--strategy", "ddp", "--devices", "1",
           "--optimizer", "cpu_adam", "--steps", "4", "--cache", str(cache), "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=clean_env())
    assert done.returncode == 0, done.stderr[-2000:]
    losses = __import__("json").loads((tmp_path / "rank0.json").read_text())["losses"]
    assert len(losses) == 4 and losses[-1] < losses[0]


def test_saved_world_size_is_read_from_the_checkpoint_layout(tmp_path: Path) -> None:
    from lit_speed.strategies.consolidate import check_resume_world_size, saved_world_size

    tag = tmp_path / "ckpt" / "checkpoint"
    tag.mkdir(parents=True)
    for rank in range(2):  # DeepSpeed writes one optimizer-state file per data-parallel rank
        (tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").touch()
    assert saved_world_size(tmp_path / "ckpt") == 2 and saved_world_size(tmp_path) is None
    check_resume_world_size(tmp_path / "ckpt", 2)
    with pytest.raises(ValueError, match=r"saved by 2 ZeRO rank\(s\) but this run has 1.*scripts/consolidate.py"):
        check_resume_world_size(tmp_path / "ckpt", 1)
