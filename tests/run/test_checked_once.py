"""The config is checked once on the way from the command line to the Trainer (issue 34): the pre-flight's
checks pass, and the runner, handed the same composition by Hydra, does not run them again; another config is."""
from __future__ import annotations

from hydra import compose, initialize_config_dir

from lit_speed.run import config_rules
from lit_speed.run.config_check import preflight
from tests.helpers.repo import CONF


def test_the_runner_does_not_check_again_what_the_preflight_checked(monkeypatch) -> None:
    calls = []
    real = config_rules._check_config
    monkeypatch.setattr(config_rules, "_check_config", lambda cfg, folders: calls.append(1) or real(cfg, folders))
    monkeypatch.setattr(config_rules, "_PASSED", set())
    argv = ["data.batch_size=24", "trainer.max_epochs=2"]
    preflight(argv)
    assert len(calls) == 1
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        as_main_composes = compose(config_name="train", overrides=argv)  # what @hydra.main hands the runner
    config_rules.check_config(as_main_composes)
    assert len(calls) == 1, "the runner checked again a config the pre-flight had checked"
    config_rules.check_config(compose_other := as_main_composes.copy())
    assert len(calls) == 1
    compose_other.data.batch_size = 32  # a sweep's next job: another config
    config_rules.check_config(compose_other)
    assert len(calls) == 2


def test_a_refused_config_is_refused_every_time(monkeypatch) -> None:
    import pytest

    from lit_speed.run.config_error import ConfigError

    monkeypatch.setattr(config_rules, "_PASSED", set())
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["seed=1.5"])
    for _ in range(2):
        with pytest.raises(ConfigError, match="seed=1.5: expected an integer"):
            config_rules.check_config(cfg)
