"""A polite stop (SIGTERM, SIGUSR1) saves the step reached, prints how to resume, and exits 128 + signum.

Before: Lightning printed "Received SIGTERM: 15", stopped at the next batch and the process exited 0 with no
checkpoint at that step, so a scheduler took the run for finished and a resume repeated the lost steps.
"""
from __future__ import annotations

import signal

import pytest
import torch

from tests.helpers.fault_scripts.compare_checkpoints import assert_bitwise_equal
from tests.helpers.fault_scripts.runs import SHORT_RUN, explain, kill_at, train

STOP_STEP = 11  # mid-epoch 2 (8 steps per epoch); the last epoch-end checkpoint is step 8


@pytest.mark.parametrize("mode, signum", [("sigterm", signal.SIGTERM),
                                          pytest.param("sigusr1", getattr(signal, "SIGUSR1", None),
                                                       marks=pytest.mark.slow)])
def test_signal_saves_the_current_step_prints_how_to_resume_and_exits_nonzero(tmp_path, mode, signum):
    run = tmp_path / "run"
    stopped = train(SHORT_RUN + kill_at(STOP_STEP, mode=mode), run)
    assert stopped.returncode == 128 + signum, explain(stopped)
    output = stopped.stdout + stopped.stderr
    assert f"interrupted at step {STOP_STEP}; resume with ckpt_path=last hydra.run.dir={run}" in output, explain(stopped)
    assert "`weights_only` was not set" not in output, explain(stopped)  # the save says what it keeps: everything
    last = run / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == STOP_STEP

    resumed = train(SHORT_RUN + ["ckpt_path=last"], run)
    assert resumed.returncode == 0, explain(resumed)
    assert f"Restored all states from the checkpoint at {last}" in resumed.stdout + resumed.stderr, explain(resumed)
    assert torch.load(last, weights_only=True)["global_step"] == 24


@pytest.mark.slow
def test_sigterm_resume_ends_bitwise_where_the_uninterrupted_run_ends(tmp_path):
    reference = train(SHORT_RUN, tmp_path / "reference")
    assert reference.returncode == 0, explain(reference)
    stopped = train(SHORT_RUN + kill_at(STOP_STEP, mode="sigterm"), tmp_path / "run")
    assert stopped.returncode == 128 + signal.SIGTERM, explain(stopped)
    resumed = train(SHORT_RUN + ["ckpt_path=last"], tmp_path / "run")
    assert resumed.returncode == 0, explain(resumed)
    assert_bitwise_equal(tmp_path / "reference" / "checkpoints" / "last.ckpt",
                         tmp_path / "run" / "checkpoints" / "last.ckpt")
