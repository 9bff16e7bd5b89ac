"""The Hydra options strategy=zero1|zero2|zero2_offload|zero3|zero3_offload and optimizer=cpu_adam."""
from __future__ import annotations

import inspect
import os
from pathlib import Path

import hydra
import pytest
import yaml

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from lit_speed.run.runner import train  # noqa: E402
from lit_speed.strategies.zero_strategy import ZeroStrategy  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = {"zero1": (1, False, False), "zero2": (2, False, False), "zero2_offload": (2, True, False),
           "zero3": (3, False, False), "zero3_offload": (3, True, True)}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_strategy_option_builds_a_zero_strategy(make_cfg, option: str) -> None:
    cfg = make_cfg([f"strategy={option}"])
    strategy = hydra.utils.instantiate(cfg.strategy)
    assert isinstance(strategy, ZeroStrategy)
    assert (strategy.stage, strategy.offload_optimizer, strategy.offload_parameters) == OPTIONS[option]


def test_yaml_keys_are_the_constructor_arguments(make_cfg) -> None:
    params = set(inspect.signature(ZeroStrategy.__init__).parameters) - {"self", "kwargs"}
    files = [ROOT / "conf" / "strategy" / f"{option}.yaml" for option in OPTIONS]
    for path in [*files, ROOT / "conf" / "base" / "zero_strategy.yaml"]:  # the base the options compose from
        keys = set(yaml.safe_load(path.read_text())) - {"_target_", "defaults"}
        assert keys <= params, keys - params
    cpu_adam = make_cfg(["optimizer=cpu_adam"]).optimizer  # composed: _partial_ comes from its base, base/adamw
    assert cpu_adam["_target_"] == "lit_speed.optim.cpu_adam.CPUAdam" and cpu_adam["_partial_"] is True


def test_raw_config_override_from_the_command_line_is_validated(make_cfg) -> None:
    cfg = make_cfg(["strategy=zero2", "+strategy.config.zero_optimization.reduce_bucket=5"])
    with pytest.raises(Exception, match="unknown key 'reduce_bucket' in zero_optimization"):
        hydra.utils.instantiate(cfg.strategy)


def test_train_with_zero2_reports_the_estimate(make_cfg) -> None:
    cfg = make_cfg(["experiment=charlm_cpu", "strategy=zero2", "trainer.accelerator=cpu", "trainer.max_steps=3",
                    "trainer.val_check_interval=3", "trainer.limit_val_batches=1", "model.n_layer=1",
                    "model.n_embd=32", "model.n_head=2", "data.max_bytes=200000", "callbacks=none",
                    "logger=none", "validate=false", "trainer.enable_progress_bar=false"])
    summary = train(cfg)
    assert summary["global_step"] == 3
    assert summary["startup"]["zero"].startswith("stage 2, offload: none, 1 rank(s), 32-true")
    zero = summary["components"]["ZeroStrategy"]
    # one rank, fp32 AdamW: the measured state equals the formula (2 fp32 moments per parameter)
    assert zero["measured_optimizer_state_bytes_rank0"] == zero["estimated_optimizer_state_bytes_per_rank"]
