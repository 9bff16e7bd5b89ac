"""Plan the memory of the run a config describes: ``scripts/plan.py`` takes ``scripts/train.py``'s overrides.

Every candidate the planner compares defaults to what the composed config would run, presets included: its
precision mode (``auto``: the modes it chooses between), its micro-batch, its ``conf/strategy`` option, its world
size, its activation checkpointing, and the optimizer it builds, which the planner asks for its state
(:func:`lit_speed.memory.planner.plan`). The baseline precision and a few micro-batches are added for comparison;
a micro-batch the config's accumulation schedule cannot divide is left out, with a note.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Sequence

import hydra
from omegaconf import DictConfig, OmegaConf

from lit_speed.memory.compile_model import repeated_block_types
from lit_speed.memory.model_state import STRATEGIES, ZeroLayout
from lit_speed.memory.planner import Plan, PlanRow, plan
from lit_speed.precision.modes import AUTO, PLAN_CANDIDATES, TIMED_CANDIDATES
from lit_speed.run.config_error import ConfigError
from lit_speed.run.config_targets import CONFIG_DIR
from lit_speed.strategies.config_facts import ConfigFacts, config_facts

#: Micro-batches compared with the configured one when none are named.
MICRO_BATCHES = (4, 8, 16, 32)
#: Overrides a plan row sets itself (the others are kept in every row's command).
ROW_KEYS = ("precision=", "data.batch_size=", "strategy=", "callbacks=", "trainer.devices=")


@dataclass
class ConfiguredRun:
    """What the composed config would run: the rows of a plan that match it are marked."""

    precisions: list[str]
    micro_batch: int | None
    strategy: str
    world_size: int
    checkpointing: bool
    callbacks: list[str] = field(default_factory=list)  # the callbacks options (keys) the config composes

    def matches(self, row: PlanRow) -> bool:
        return (row.precision in self.precisions and row.micro_batch == self.micro_batch
                and row.strategy == self.strategy and row.checkpointing == self.checkpointing
                and row.world_size == self.world_size)


def configured_precisions(cfg: DictConfig, facts: ConfigFacts | None = None) -> list[str]:
    """The mode the config trains in; for ``auto``, the modes it times on a CPU with native bf16."""
    mode = (facts or config_facts(cfg)).precision_mode
    if mode is None:
        return []
    return list(TIMED_CANDIDATES) if mode == AUTO else [mode]


def configured_strategy(cfg: DictConfig, facts: ConfigFacts | None = None) -> str:
    """The ``conf/strategy`` option whose layout (ZeRO stage, offload) the config's strategy trains in: a
    ``ZeroStrategy``'s stage and offload, ``ddp`` for Lightning's DDP, else ``auto`` (a registry name, another
    DeepSpeed strategy).

    Raises:
        ConfigError: For a ZeRO layout no option plans (e.g. stage 1 with offload): name one with ``--strategies``.
    """
    strategy = (facts or config_facts(cfg)).strategy
    if strategy.zero:
        layout = ZeroLayout(strategy.stage, strategy.offload_optimizer, strategy.offload_parameters, deepspeed=True)
        option = next((name for name, known in STRATEGIES.items() if known == layout), None)
        if option is None:
            raise ConfigError(f"strategy: the planner has no option for {layout} (it plans {', '.join(STRATEGIES)}). "
                              "Fix: --strategies <one of those>")
        return option
    return "ddp" if strategy.ddp and not strategy.deepspeed else "auto"


def configured_world_size(cfg: DictConfig, facts: ConfigFacts | None = None) -> int:
    """The configured processes; 1 where the config leaves them to the machine (``trainer.devices=auto``)."""
    return (facts or config_facts(cfg)).processes or 1


def configured_checkpointing(cfg: DictConfig, facts: ConfigFacts | None = None) -> bool:
    return (facts or config_facts(cfg)).checkpointing


def usable_micro_batches(cfg: DictConfig, candidates: Sequence[int], world_size: int) -> tuple[list[int], list[str]]:
    """The candidates the config's accumulation schedule can use: an ``effective_batch`` schedule stepped by
    ``ramp: step`` needs every value divisible by micro-batch x processes (``AccumulationScheduler`` refuses the
    rest)."""
    node = cfg.get("accumulation")
    schedule = node.get("effective_batch") if isinstance(node, DictConfig) else None
    if schedule is None or node.get("ramp") != "step":
        return list(candidates), []
    values = [int(pair[1]) for pair in schedule] if not isinstance(schedule, DictConfig) else \
        [int(v) for v in schedule.values()]
    kept = [b for b in candidates if all(v % (b * world_size) == 0 for v in values)]
    dropped = sorted(set(candidates) - set(kept))
    notes = [f"micro-batches {', '.join(map(str, dropped))} left out: accumulation.effective_batch {values} is not "
             f"divisible by them x {world_size} process(es)"] if dropped else []
    return kept, notes


def _default_callbacks() -> list[str]:
    """The options ``callbacks=default`` composes (its defaults list)."""
    path = CONFIG_DIR / "callbacks" / "default.yaml"
    entries = OmegaConf.load(path).get("defaults") or [] if path.is_file() else []
    return [str(e) for e in entries if isinstance(e, str) and e != "_self_"]


def configured_run(cfg: DictConfig, facts: ConfigFacts | None = None) -> ConfiguredRun:
    facts = facts or config_facts(cfg)
    batch = cfg.get("data", {}).get("batch_size") if isinstance(cfg.get("data"), DictConfig) else None
    callbacks = cfg.get("callbacks")
    options = [str(k) for k, v in callbacks.items() if isinstance(v, DictConfig) and k != "activation_checkpointing"] \
        if isinstance(callbacks, DictConfig) else []  # each bundled callbacks option composes a key named after it
    default = _default_callbacks()
    if default and set(default) <= set(options):
        options = ["default", *[o for o in options if o not in default]]
    return ConfiguredRun(configured_precisions(cfg, facts), batch if isinstance(batch, int) else None,
                         configured_strategy(cfg, facts), configured_world_size(cfg, facts),
                         configured_checkpointing(cfg, facts), options)


def plan_run(cfg: DictConfig, overrides: Sequence[str], budget_bytes: int | None = None,
             micro_batches: Sequence[int] | None = None, precisions: Sequence[str] | None = None,
             checkpoint: Sequence[str] | None = None, strategies: Sequence[str] | None = None,
             world_size: int | None = None) -> tuple[Plan, ConfiguredRun]:
    """Build the config's model, data and optimizer and plan them; ``None`` candidates come from the config.

    Args:
        cfg: The composed config (``lit_speed.run.config_check.preflight``).
        overrides: The command line: every row's command keeps those a row does not set itself.
        budget_bytes: Device memory per process.
        micro_batches, precisions, checkpoint, strategies, world_size: Candidates; ``None`` = the configured one
            (plus the baseline precision and :data:`MICRO_BATCHES` for comparison; checkpointing rows for the model's
            repeated block types).

    Raises:
        ConfigError: When the config's accumulation schedule leaves no micro-batch to plan.
    """
    facts = config_facts(cfg)
    configured = configured_run(cfg, facts)
    world = world_size or configured.world_size
    candidates = list(micro_batches) if micro_batches else sorted({*MICRO_BATCHES, *([configured.micro_batch]
                                                                                      if configured.micro_batch else [])})
    candidates, notes = usable_micro_batches(cfg, candidates, world)
    if not candidates:
        raise ConfigError(f"--micro-batches: none divides accumulation.effective_batch (x {world} process(es)). "
                          "Fix: --micro-batches <divisors of the effective batches>")
    modes = list(precisions) if precisions else list(dict.fromkeys([*configured.precisions, *PLAN_CANDIDATES]))
    datamodule = hydra.utils.instantiate(cfg.data)
    factory = hydra.utils.instantiate(cfg.optimizer, _convert_="all")
    model = hydra.utils.instantiate(cfg.model, optimizer=factory)
    if facts.adapters is not None:  # adapters on a frozen base: fewer gradients and optimizer state
        hydra.utils.instantiate(facts.adapters, export_dir=None).prepare_model(model)  # no run folder here
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    if checkpoint is None:  # the repeated blocks (GPT: Block); a model without them gets no checkpointing rows
        checkpoint = sorted({cls.__name__ for cls in repeated_block_types(model)})
        if not checkpoint:
            notes.append("no repeated block type in this model: no checkpointing rows (name one with --checkpoint)")
    base = [o for o in overrides if not o.startswith(ROW_KEYS)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = plan(model, batch, budget_bytes, candidates, modes, checkpoint, list(strategies or
                      [configured.strategy]), world, factory, base, callbacks=configured.callbacks)
    result.notes += notes
    return result, configured


def describe_configured(configured: ConfiguredRun) -> str:
    """One line: what the config runs, as the rows marked ``*`` show it."""
    modes = " or ".join(configured.precisions) or "Lightning's default"
    chosen = " (precision=auto picks one by timing at the first batch)" if len(configured.precisions) > 1 else ""
    return (f"* = this config's run: precision {modes}{chosen}, micro-batch {configured.micro_batch}, strategy "
            f"{configured.strategy} x{configured.world_size}, checkpointing "
            f"{'on' if configured.checkpointing else 'off'}")

