"""ZeroStrategy with 2 processes on CPU (gloo): Lightning's own launcher and torchrun. Slow tier.

Each run is ``tests/helpers/zero.py`` in a subprocess, writing one JSON per rank. The data are read in order, so
one process with batch 8 sees exactly the windows two processes with batch 4 see at each step: the mean of the
two ranks' losses must equal the single-process loss.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.zero import clean_env

pytestmark = pytest.mark.slow  # every test starts 2+ Python processes that import torch, Lightning and DeepSpeed

ROOT = Path(__file__).resolve().parents[2]
HELPER = str(ROOT / "tests" / "helpers" / "zero.py")
STEPS = 5
# fp32 everywhere. Two ranks average two half-batch gradients instead of one full-batch mean (a different
# summation order) and ZeRO steps a flat buffer: differences stay in the last float32 bits, growing over a few
# steps; 1e-4 relative is far below the 2-3% a wrong averaging or a skipped rank's batch would cause.
LOSS_RTOL = 1e-4


def _run(tmp: Path, name: str, *args: str, launcher: list[str] | None = None) -> list[dict]:
    out = tmp / name
    cmd = (launcher or [sys.executable]) + [HELPER, "--cache", str(tmp / "cache"), "--out", str(out),
                                            "--steps", str(STEPS), *args]
    env = clean_env(OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def _mean_losses(ranks: list[dict]) -> list[float]:
    return [sum(r["losses"][i] for r in ranks) / len(ranks) for i in range(len(ranks[0]["losses"]))]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("zero2p")


@pytest.fixture(scope="module")
def single(tmp: Path) -> list[dict]:
    """The non-ZeRO single-process reference: plain DDP, 1 process, batch 8."""
    return _run(tmp, "single", "--strategy", "ddp", "--devices", "1", "--batch", "8")


@pytest.fixture(scope="module")
def ddp2(tmp: Path) -> list[dict]:
    return _run(tmp, "ddp2", "--strategy", "ddp", "--devices", "2", "--batch", "4")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_processes_match_one(tmp: Path, single: list[dict], ddp2: list[dict], stage: int) -> None:
    ranks = _run(tmp, f"zero{stage}", "--stage", str(stage), "--devices", "2", "--batch", "4")
    assert [r["world_size"] for r in ranks] == [2, 2] and ranks[0]["global_step"] == STEPS
    assert ranks[0]["losses"] != ranks[1]["losses"]  # each rank trained on its own half of the batch
    assert _mean_losses(ranks) == pytest.approx(single[0]["losses"], rel=LOSS_RTOL)
    if stage in (1, 2):
        # measured from the optimizer's own state tensors on each rank, not from the formula
        for zero_rank, ddp_rank in zip(ranks, ddp2):
            ratio = zero_rank["optimizer_state_bytes"] / ddp_rank["optimizer_state_bytes"]
            assert ratio == pytest.approx(0.5, abs=0.05), ratio  # partitions are padded for alignment


@pytest.mark.parametrize("stage", [2, 3])
def test_offload_with_cpu_adam_matches_one_process(tmp: Path, single: list[dict], stage: int) -> None:
    # needs DeepSpeedCPUAdam: the first use JIT-builds it (~2 min on 2 cores), cached afterwards.
    # The reference keeps torch AdamW: DeepSpeedCPUAdam outside a DeepSpeed engine segfaults under Lightning
    # (Lightning's optimizer wrapper inherits CPUAdam's __del__, which frees the C++ state the original
    # still uses). Same AdamW math, different kernels (AVX vs ATen): rounding differs per step, so the
    # tolerance is 1e-3 relative, still far below what a lost gradient shard or a wrong average would cost.
    ranks = _run(tmp, f"zero{stage}_offload", "--stage", str(stage), "--offload", "--devices", "2",
                 "--batch", "4", "--optimizer", "cpu_adam")
    assert _mean_losses(ranks) == pytest.approx(single[0]["losses"], rel=1e-3)


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
def test_torchrun_launch_matches_lightnings_launcher(tmp: Path, single: list[dict]) -> None:
    # the multi-node path: torchrun sets RANK/WORLD_SIZE/MASTER_ADDR; Lightning's TorchElasticEnvironment
    # picks them up and does not spawn. On a cluster: --nnodes=N --node_rank=i --rdzv-endpoint=host:port
    launcher = ["torchrun", "--standalone", "--nnodes=1", "--nproc_per_node=2"]
    ranks = _run(tmp, "torchrun", "--stage", "2", "--devices", "2", "--batch", "4", launcher=launcher)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert _mean_losses(ranks) == pytest.approx(single[0]["losses"], rel=LOSS_RTOL)


def test_resume_in_a_different_world_size_is_refused_with_the_ways_out(tmp: Path) -> None:
    # DeepSpeed 0.19 cannot re-partition ZeRO optimizer state for a new world size; ZeroStrategy says so
    # before DeepSpeed fails deep inside load_checkpoint, and names the alternatives
    epoch = ["--train-windows", "24", "--stage", "2"]
    _run(tmp, "two_ws", *epoch, "--devices", "2", "--batch", "4", "--save-every", "3")
    ckpt = tmp / "two_ws" / "ckpt" / "epoch=0-step=3.ckpt"
    assert ckpt.is_dir()
    cmd = [sys.executable, HELPER, "--cache", str(tmp / "cache"), "--out", str(tmp / "one_ws"), "--steps", str(STEPS),
           *epoch, "--devices", "1", "--batch", "8", "--resume", str(ckpt)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=clean_env())
    assert done.returncode != 0
    assert "was saved by 2 ZeRO rank(s) but this run has 1" in done.stderr
    assert "scripts/consolidate.py" in done.stderr
