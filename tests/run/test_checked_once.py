"""The config is checked once on the way from the command line to the Trainer (issues 34, 51): ``scripts/train.py``
checks the composition ``@hydra.main`` makes before the job starts and hands it to the runner as checked; a config
given to :func:`~lit_speed.run.runner.train` otherwise is checked there. (A real run's count of compositions and
checks: ``tests/test_architecture.py``.)"""
from __future__ import annotations

import pytest

from lit_speed.run import runner
from lit_speed.run.config_error import ConfigError

QUIET = ["trainer.max_steps=1", "trainer.limit_val_batches=0", "validate=false", "logger=none", "callbacks=none",
         "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


def test_the_runner_checks_a_config_unless_told_it_was_checked(make_cfg, monkeypatch) -> None:
    calls = []
    real = runner.check_config
    monkeypatch.setattr(runner, "check_config", lambda cfg: calls.append(1) or real(cfg))
    cfg = make_cfg(QUIET)
    runner.train(cfg)
    assert len(calls) == 1
    runner.train(cfg, checked=True)
    assert len(calls) == 1, "the runner checked again a config the pre-flight had checked"


def test_a_refused_config_is_refused_every_time(make_cfg) -> None:
    cfg = make_cfg(["seed=1.5"])
    for _ in range(2):
        with pytest.raises(ConfigError, match="seed=1.5: expected an integer"):
            runner.train(cfg)
