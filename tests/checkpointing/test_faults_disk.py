"""A checkpoint that cannot be written (disk full, read-only or forbidden folder) stops the run like a signal does:
one line naming what failed, the space needed and free, the last checkpoint that verifies and the resume command;
exit 74 (EX_IOERR); the previous checkpoint intact; and after making room the resume ends where the uninterrupted
run ends."""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from lit_speed.checkpointing import CheckpointWriteError, verify_checkpoint
from lit_speed.checkpointing.atomic_checkpoint_io import AtomicCheckpointIO
from tests.helpers.fault_scripts.compare_checkpoints import assert_bitwise_equal
from tests.helpers.fault_scripts.runs import SHORT_RUN, STEPS_PER_EPOCH, explain, kill_at, train

EX_IOERR = 74


def _one_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("Run stopped:")]
    assert len(lines) == 1, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    return lines[0]


def test_write_errors_of_a_full_or_forbidden_disk_become_a_checkpoint_write_error(tmp_path, monkeypatch):
    import lit_speed.checkpointing.atomic_checkpoint_io as atomic_io

    io = AtomicCheckpointIO()
    io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "last.ckpt")
    for code in (errno.ENOSPC, errno.EACCES, errno.EROFS):
        def fail(fd, code=code):
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(atomic_io.os, "fsync", fail)
        with pytest.raises(CheckpointWriteError, match=r"could not write checkpoint .*last\.ckpt: .*MiB free\)"):
            io.save_checkpoint({"w": torch.zeros(3)}, tmp_path / "last.ckpt")
        monkeypatch.undo()
        assert not list(tmp_path.glob(".*.tmp-*"))  # the half-written file is gone
        assert torch.equal(torch.load(tmp_path / "last.ckpt")["w"], torch.ones(3))  # the previous one intact
    monkeypatch.setattr(atomic_io.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(OSError) as raised:  # not a full/forbidden disk: not turned into a CheckpointWriteError
        io.save_checkpoint({"w": torch.zeros(3)}, tmp_path / "last.ckpt")
    assert not isinstance(raised.value, CheckpointWriteError)


@pytest.mark.slow
def test_disk_full_at_a_save_stops_in_one_line_and_resumes_exactly_after_making_room(tmp_path):
    # every write fails from step 10 on: the epoch-2 save (step 16) fails; last.ckpt stays the step-8 one
    reference = train(SHORT_RUN, tmp_path / "reference")
    assert reference.returncode == 0, explain(reference)
    full = train(SHORT_RUN + kill_at(STEPS_PER_EPOCH + 2, mode="disk_full"), tmp_path / "run")
    assert full.returncode == EX_IOERR, explain(full)
    line = _one_line(full)
    folder = tmp_path / "run" / "checkpoints"
    assert "No space left on device" in line and "MiB free" in line, line
    assert f"the last checkpoint that verifies is {folder}" in line, line
    assert f"resume with ckpt_path=last hydra.run.dir={tmp_path / 'run'}" in line, line
    last = folder / "last.ckpt"
    verify_checkpoint(last)
    assert torch.load(last, weights_only=True)["global_step"] == STEPS_PER_EPOCH
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and "No space left on device" in summary["stopped"]

    resumed = train(SHORT_RUN + ["ckpt_path=last"], tmp_path / "run")  # room made: the injection is gone
    assert resumed.returncode == 0, explain(resumed)
    assert_bitwise_equal(tmp_path / "reference" / "checkpoints" / "last.ckpt", last)


def _mount_tmpfs(folder: Path, size: str) -> bool:
    folder.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None or os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True).returncode == 0


@pytest.mark.slow
def test_a_real_full_filesystem_stops_in_one_line_with_the_checkpoint_intact(tmp_path):
    """A run folder on a tmpfs that holds the first checkpoints but not the later ones (no injection)."""
    run = tmp_path / "small_disk"
    if not _mount_tmpfs(run, "4500k"):
        pytest.skip("needs root and `mount -t tmpfs` to make a small filesystem (the injected ENOSPC test covers "
                    "the logic without it)")
    try:
        # 1.8 MB per checkpoint: epoch 1 writes best + last (3.6 MB); epoch 2's new best does not fit
        args = [a for a in SHORT_RUN if not a.startswith("trainer.max_epochs")] + [
            "trainer.max_epochs=12", "model.hidden=256", "model.depth=3"]
        proc = train(args, run)
        assert proc.returncode == EX_IOERR, explain(proc)
        line = _one_line(proc)
        assert "No space left on device" in line and "resume with ckpt_path=last" in line, line
        verify_checkpoint(run / "checkpoints" / "last.ckpt")
        assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == STEPS_PER_EPOCH
        assert not list((run / "checkpoints").glob(".*.tmp-*"))
    finally:
        subprocess.run(["umount", str(run)], capture_output=True)
