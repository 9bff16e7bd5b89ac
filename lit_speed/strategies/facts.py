"""What a component may ask of the strategy it runs under: DeepSpeed or not, which ZeRO stage, how many processes.

One function for every component (precision, the optimizer factory, accumulation, adapters), instead of each
reading class names or DeepSpeed's config dict its own way. Works on any Lightning strategy, ours or not, and on
stand-ins that only carry a class name (the checks read the class hierarchy's names, not ``isinstance``, so that a
test need not import DeepSpeed).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StrategyFacts:
    """``deepspeed``: a DeepSpeed strategy (it owns backward, step and loss scaling); ``zero_stage``: 0-3 under
    DeepSpeed (0 = no ZeRO sharding), ``None`` otherwise; ``processes``: processes training the model."""

    deepspeed: bool
    zero_stage: int | None
    processes: int
    names: frozenset[str]

    def is_a(self, *class_names: str) -> bool:
        """Whether the strategy is (a subclass of) one of ``class_names``, e.g. ``is_a("DDPStrategy")``."""
        return bool(self.names & set(class_names))


def strategy_facts(strategy: Any, world_size: int | None = None) -> StrategyFacts:
    """The facts of ``strategy`` (``None``: a single process, no DeepSpeed).

    Args:
        world_size: Processes, when the caller knows them better than the strategy (``trainer.world_size``);
            ``None`` = the strategy's ``world_size`` (1 when it has none yet).
    """
    names = frozenset(cls.__name__ for cls in type(strategy).__mro__) if strategy is not None else frozenset()
    deepspeed = "DeepSpeedStrategy" in names
    stage = None
    if deepspeed:
        config = getattr(strategy, "config", None)
        zero = config.get("zero_optimization") if isinstance(config, dict) else None
        stage = int(zero.get("stage", 0)) if isinstance(zero, dict) else int(getattr(strategy, "stage", 0) or 0)
    processes = world_size if world_size is not None else int(getattr(strategy, "world_size", 1) or 1)
    return StrategyFacts(deepspeed=deepspeed, zero_stage=stage, processes=processes, names=names)
