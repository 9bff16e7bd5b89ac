"""A checkpoint whose unpickling would run code is treated like a damaged one, and the code never runs.

torch's safe load (``weights_only=True``, the default for local files) refuses such a file with an
``UnpicklingError`` whose text suggests ``weights_only=False`` - the one thing that would run the payload.
:func:`verify_checkpoint` disassembles the pickle instead of running it, so ``ckpt_path=last`` skips the file
with a warning naming the offending global, and a named file is refused in one line.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lit_speed.checkpointing import CorruptCheckpointError, last_good_checkpoint, verify_checkpoint  # noqa: E402
from tests.helpers.fault_scripts.runs import SHORT_RUN, explain, train


class TouchMarker:
    """Unpickling this object runs ``touch <marker>`` (a harmless stand-in for an attacker's command)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _good(path: Path, step: int) -> Path:
    torch.save({"state_dict": {"w": torch.full((2,), float(step))}, "global_step": step}, path)
    return path


@pytest.mark.parametrize("alone", [True, False], ids=["payload-alone", "payload-as-extra-key"])
def test_last_skips_a_checkpoint_holding_a_payload_with_a_warning_naming_it(tmp_path, alone):
    marker = tmp_path / "payload_ran"
    older = _good(tmp_path / "epoch=0.ckpt", 1)
    os.utime(older, (1, 1))
    bad = tmp_path / "last.ckpt"
    payload = TouchMarker(marker)
    torch.save(payload if alone else {"state_dict": {"w": torch.ones(2)}, "global_step": 2, "extra": payload}, bad)

    with pytest.warns(UserWarning, match=r"last\.ckpt is unusable: it holds objects other than tensors and plain "
                                         r"data \(posix\.system\).*Trying the next older checkpoint"):
        assert last_good_checkpoint([tmp_path]) == older
    with pytest.raises(CorruptCheckpointError) as refused:
        verify_checkpoint(bad)
    assert "weights_only" not in str(refused.value) and "\n" not in str(refused.value)
    assert not marker.exists(), "the payload ran"


def test_a_named_checkpoint_holding_a_payload_is_refused_in_one_line(tmp_path):
    marker = tmp_path / "payload_ran"
    bad = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "extra": TouchMarker(marker)}, bad)
    proc = train(SHORT_RUN + [f"ckpt_path={bad}"], tmp_path / "run")
    assert proc.returncode == 2, explain(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Config error:")]
    assert len(errors) == 1 and "evil.ckpt is unusable" in errors[0] and "posix.system" in errors[0], explain(proc)
    assert "Traceback" not in proc.stderr and "weights_only" not in proc.stderr, explain(proc)
    assert not marker.exists(), "the payload ran"
