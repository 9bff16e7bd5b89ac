"""``lit_speed.strategy_facts``: the one answer to "DeepSpeed? which stage? how many processes?" (issue 34)."""
from __future__ import annotations

import pytest
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from lit_speed import StrategyFacts, strategy_facts


def test_no_strategy_is_one_process_without_deepspeed() -> None:
    assert strategy_facts(None) == StrategyFacts(deepspeed=False, zero_stage=None, processes=1, names=frozenset())


def test_lightnings_own_strategies() -> None:
    ddp = strategy_facts(DDPStrategy(), world_size=2)
    assert (ddp.deepspeed, ddp.zero_stage, ddp.processes) == (False, None, 2)
    assert ddp.is_a("DDPStrategy") and not ddp.is_a("FSDPStrategy")
    single = strategy_facts(SingleDeviceStrategy("cpu"))
    assert (single.deepspeed, single.processes) == (False, 1)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_strategy_reports_its_stage(stage) -> None:
    from lit_speed import ZeroStrategy

    facts = strategy_facts(ZeroStrategy(stage=stage), world_size=4)
    assert (facts.deepspeed, facts.zero_stage, facts.processes) == (True, stage, 4)


def test_a_deepspeed_subclass_stand_in_is_read_by_its_class_names_and_config() -> None:
    """No DeepSpeed import needed: the class hierarchy's names and DeepSpeed's config dict are what is read."""
    class DeepSpeedStrategy:  # noqa: D101 - a stand-in with Lightning's class name
        config = {"zero_optimization": {"stage": 2}}
        world_size = 3

    class Mine(DeepSpeedStrategy):
        pass

    assert strategy_facts(Mine()) == StrategyFacts(True, 2, 3, frozenset({"Mine", "DeepSpeedStrategy", "object"}))
    Mine.config = {}
    assert strategy_facts(Mine()).zero_stage == 0  # DeepSpeed without a ZeRO section
