"""A ZeRO checkpoint folder cut mid-write is moved aside at resume, so ``last.ckpt`` names a good checkpoint again.

DeepSpeed writes its checkpoint folders file by file. Before, a run killed inside the save of ``last.ckpt/``
resumed correctly from the previous checkpoint but then wrote ``last-v1.ckpt`` next to the damaged
``last.ckpt/``, which ``scripts/consolidate.py`` refuses.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from lit_speed.checkpointing import verify_checkpoint  # noqa: E402
from tests.helpers.fault_scripts.compare_checkpoints import assert_bitwise_equal
from tests.helpers.fault_scripts.runs import ROOT, SHORT_RUN, env, explain, kill_at, train, train_side_by_side

SIGKILLED = -9
ZERO2 = SHORT_RUN + ["strategy=zero2"]


@pytest.mark.slow  # three ZeRO-2 runs
def test_sigkill_inside_a_zero2_save_moves_the_damaged_folder_aside_at_resume(tmp_path):
    # dies inside the first save of last.ckpt/ (step 8, end of epoch 1)
    reference, killed = train_side_by_side((ZERO2, tmp_path / "reference"),
                                           (ZERO2 + kill_at(1, mode="in_zero_last_save"), tmp_path / "run"))
    assert reference.returncode == 0, explain(reference)
    assert killed.returncode == SIGKILLED, explain(killed)
    folder = tmp_path / "run" / "checkpoints"
    with pytest.raises(ValueError, match="truncated"):
        verify_checkpoint(folder / "last.ckpt")

    resumed = train(ZERO2 + ["ckpt_path=last"], tmp_path / "run")
    assert resumed.returncode == 0, explain(resumed)
    names = sorted(p.name for p in folder.iterdir())
    assert not any("-v1" in n for n in names), names  # before: last-v1.ckpt next to the damaged last.ckpt/
    assert "last.ckpt" in names and "last.ckpt.damaged-0" in names, names
    assert "The damaged folder was moved to last.ckpt.damaged-0" in resumed.stdout + resumed.stderr, explain(resumed)
    verify_checkpoint(folder / "last.ckpt")
    assert_bitwise_equal(tmp_path / "reference" / "checkpoints" / "last.ckpt", folder / "last.ckpt")

    out = subprocess.run([sys.executable, "scripts/consolidate.py", str(folder / "last.ckpt"), str(tmp_path / "c.ckpt")],
                         cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and (tmp_path / "c.ckpt").exists(), out.stderr[-2000:]
