"""The ``deepspeed`` launcher appends ``--local_rank=N`` to each worker's command line; Hydra refuses it (before:
``Config error: --local_rank=1: Hydra refuses it`` on both ranks, exit 2). scripts/train.py drops it first."""
from __future__ import annotations

import os

import pytest

from lit_speed.run.launch_env import drop_local_rank_argument


@pytest.mark.parametrize("argv", [["--local_rank=1", "strategy=zero2"], ["--local-rank=1", "strategy=zero2"],
                                  ["strategy=zero2", "--local_rank", "1"]])
def test_the_launchers_local_rank_argument_is_dropped_and_kept_in_the_environment(argv, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "")  # recorded, so the variable is restored (unset) after the test
    monkeypatch.delenv("LOCAL_RANK")
    assert drop_local_rank_argument(argv) == ["strategy=zero2"]
    assert os.environ["LOCAL_RANK"] == "1"


def test_other_arguments_pass_unchanged(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    argv = ["-m", "trainer.devices=2", "hydra.run.dir=/x/--local_rank"]
    assert drop_local_rank_argument(argv) == argv
