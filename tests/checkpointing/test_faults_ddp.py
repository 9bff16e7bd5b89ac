"""Two-process DDP on CPU (gloo): when one rank is SIGKILLed, the other exits with a clear error instead of
hanging, and the last checkpoint stays loadable.

The bound on "no hang" is the subprocess timeout: a survivor blocked in a collective would wait for the
process-group timeout (30 min by default), far beyond it. gloo notices a dead peer at once (its socket
closes), so the survivor fails in its next collective with "Connection closed by peer", and FaultTolerance
turns that into one line naming the last checkpoint that verifies. A peer that hangs without dying is only
caught by the process-group timeout: set it shorter with
``+strategy.timeout._target_=datetime.timedelta +strategy.timeout.seconds=120`` (strategy=ddp).
"""
from __future__ import annotations

import re

import pytest
import torch

from lit_speed.checkpointing import verify_checkpoint  # noqa: E402
from tests.helpers.fault_scripts.runs import SHORT_RUN, STEPS_PER_EPOCH, explain, kill_at, train

pytestmark = pytest.mark.slow  # two processes, each importing torch + Lightning: ~1 min on 2 cores

BOUND_S = 600  # a hang would last the 30 min process-group timeout


@pytest.mark.parametrize("dead_rank", [1, 0], ids=["worker_dies", "launcher_dies"])
def test_killing_one_ddp_rank_makes_the_other_exit_with_a_clear_error(tmp_path, dead_rank):
    args = SHORT_RUN + ["trainer=ddp_cpu", "strategy=ddp"] + kill_at(STEPS_PER_EPOCH + 2, rank=dead_rank)
    proc = train(args, tmp_path, timeout=BOUND_S)  # returns once both processes have closed their output
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, explain(proc)
    survivor = 1 - dead_rank
    assert re.search(rf"\[rank: {survivor}\] Lost contact with another process of this run at step \d+ "
                     r"\(RuntimeError: .*\): a process died or stopped answering\. Last checkpoint that verifies: .*last\.ckpt",
                     output), explain(proc)

    last = tmp_path / "checkpoints" / "last.ckpt"
    verify_checkpoint(last)
    assert torch.load(last, weights_only=True)["global_step"] == STEPS_PER_EPOCH  # the epoch-1 checkpoint
