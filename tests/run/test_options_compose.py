"""Shipped options compose (issue 50, item 7): every experiment with every accumulation option passes the pre-flight
and the accumulation plan (the effective-batch row's ``AccumulationPlan.accumulation_plan``, which refuses a schedule
the micro-batch cannot hold), and the ramp option holds for every data option's micro-batch.

Before: ``experiment=charlm_cpu accumulation=ramp`` stopped with "effective_batch[0] = 64 is not divisible by
micro_batch (12)" (the ramp was written in samples for digits' 64), and ``experiment=charlm_fast accumulation=none``
or ``=fixed`` were refused (the preset set the ramp option's keys instead of choosing an option of its own).
"""
from __future__ import annotations

import hydra.utils
import pytest
from omegaconf import DictConfig

from lit_speed.run.config_check import preflight
from lit_speed.strategies.config_facts import configured_processes
from tests.helpers.repo import CONF, compose_config

EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
ACCUMULATION = sorted(p.stem for p in (CONF / "accumulation").glob("*.yaml"))
DATA = sorted(p.stem for p in (CONF / "data").glob("*.yaml"))


def _plan(cfg: DictConfig) -> tuple[int, int, str] | None:
    """The accumulation plan the run's start-up row shows (``None``: no accumulation callback)."""
    node = cfg.get("accumulation")
    if not isinstance(node, DictConfig) or "_target_" not in node:
        return None
    scheduler = hydra.utils.instantiate(node)
    return scheduler.accumulation_plan(int(cfg.data.batch_size), configured_processes(cfg) or 1)


@pytest.mark.parametrize("accumulation", ACCUMULATION)
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_with_every_accumulation_option(experiment, accumulation):
    cfg = preflight([f"experiment={experiment}", f"accumulation={accumulation}"])
    plan = _plan(cfg)  # None: nothing accumulates (accumulation=none, unless a preset builds a scheduler anyway)
    assert plan is None or 1 <= plan[0] <= plan[1]
    assert plan is not None or accumulation == "none"


@pytest.mark.parametrize("data", DATA)
def test_the_ramp_holds_for_every_data_option_s_micro_batch(tmp_path, data):
    cfg = compose_config([f"data={data}", "accumulation=ramp"], tmp_path)
    if not isinstance(cfg.data.get("batch_size"), int):
        pytest.skip(f"data={data} sets no micro-batch of its own")
    start, largest, then = _plan(cfg)
    assert (start, largest) == (1, 4) and then.startswith("rising linearly")
