"""A stop signal to a 2-process run (DDP, ZeRO-2; Lightning's own launcher) stops every process after the same batch,
saves one checkpoint, prints how to resume and exits 143; with ``signal_deadline_s`` it does so even when the
running step would end much later, saving the last completed step. The resume ends bitwise on the uninterrupted run.

Before (issue 33): ``kill -TERM <main pid>`` of ``trainer.devices=2 strategy=ddp`` hung 2 times in 2: Lightning
2.6.6's SIGTERM handler runs a ``dist.broadcast`` inside the handler, which pairs with whatever collective the other
process runs next; both then waited in a futex forever and nothing was saved.

The bound on "no hang" is each run's subprocess timeout; the deadline case's step sleeps 600 s, longer than that
timeout, so only the deadline path can end the run in time (no wall-clock number is asserted).
"""
from __future__ import annotations

import random
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.helpers.fault_scripts.compare_checkpoints import assert_bitwise_equal
from tests.helpers.fault_scripts.runs import SHORT_RUN, explain, kill_at, signal_after, train, train_side_by_side

pytestmark = pytest.mark.slow  # two processes, each importing torch + Lightning (+ DeepSpeed): minutes on 2 cores

TWO = ["trainer=ddp_cpu"]  # 2 processes through Lightning's own launcher; 3 epochs x 8 batches, checkpoint per epoch
BOUND_S = 300  # a hang would last the process-group timeout (5 min under strategy=ddp) or forever
SLOW = ["+callbacks.slow._target_=tests.helpers.fault_scripts.slow_step.SlowStep", "+callbacks.slow.seconds=600",
        "+callbacks.slow.from_step=13"]  # step 14 would take 10 minutes


def _step_of(checkpoint: Path) -> int:
    if checkpoint.is_dir():  # DeepSpeed: Lightning's own keys ride in the model-states file
        checkpoint = next(checkpoint.rglob("*model_states.pt"))
    return int(torch.load(checkpoint, map_location="cpu", weights_only=False)["global_step"])


def _assert_bitwise(reference: Path, resumed: Path) -> None:
    assert_bitwise_equal(reference / "checkpoints" / "last.ckpt", resumed / "checkpoints" / "last.ckpt")


def _no_process_left(run: Path) -> None:
    left = subprocess.run(["pgrep", "-f", f"hydra.run.dir={run}"], capture_output=True, text=True).stdout.split()
    assert not left, f"processes of the stopped run still alive: {left}"


@pytest.mark.parametrize("strategy, rank", [("ddp", 0), ("zero2", 0), ("ddp", -1)],
                         ids=["ddp-main-process", "zero2-main-process", "ddp-process-group"])
def test_sigterm_stops_every_process_after_the_same_batch_and_resumes_bitwise(tmp_path, strategy, rank, request):
    step = random.Random(request.node.callspec.id).randint(9, 22)  # seeded: reruns stop at the same step
    args = SHORT_RUN + TWO + [f"strategy={strategy}"]
    reference, stopped = train_side_by_side((args, tmp_path / "reference"),
                                            (args + kill_at(step, rank=rank, mode="sigterm"), tmp_path / "run"),
                                            timeout=BOUND_S)
    assert reference.returncode == 0, explain(reference)
    assert stopped.returncode == 128 + signal.SIGTERM, explain(stopped)
    output = stopped.stdout + stopped.stderr
    assert output.count("interrupted at step") == 1, explain(stopped)  # rank 0 says it, once
    assert f"resume with ckpt_path=last hydra.run.dir={tmp_path / 'run'}" in output, explain(stopped)
    assert _step_of(tmp_path / "run" / "checkpoints" / "last.ckpt") in (step, step + 1)  # the batch after the signal
    _no_process_left(tmp_path / "run")

    resumed = train(args + ["ckpt_path=last"], tmp_path / "run", timeout=BOUND_S)
    assert resumed.returncode == 0, explain(resumed)
    _assert_bitwise(tmp_path / "reference", tmp_path / "run")


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_a_step_longer_than_the_deadline_saves_the_last_completed_step_and_exits_143(tmp_path, strategy):
    args = SHORT_RUN + TWO + [f"strategy={strategy}", "callbacks.fault_tolerance.signal_deadline_s=8"]
    with ThreadPoolExecutor(2) as pool:
        reference_job = pool.submit(train, args, tmp_path / "reference", BOUND_S)
        stopped = signal_after(args + SLOW, tmp_path / "run", "slow step 14 begins", 1.0, signal.SIGTERM,
                               timeout=BOUND_S)
        reference = reference_job.result()
    assert reference.returncode == 0, explain(reference)
    assert stopped.returncode == 128 + signal.SIGTERM, explain(stopped)
    assert ("interrupted at step 13; resume with ckpt_path=last" in stopped.stdout
            and "the last completed step was saved" in stopped.stdout), explain(stopped)
    assert _step_of(tmp_path / "run" / "checkpoints" / "last.ckpt") == 13
    _no_process_left(tmp_path / "run")

    resumed = train(args + ["ckpt_path=last"], tmp_path / "run", timeout=BOUND_S)
    assert resumed.returncode == 0, explain(resumed)
    _assert_bitwise(tmp_path / "reference", tmp_path / "run")
