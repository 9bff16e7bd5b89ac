"""Refuse a composed config that cannot train, from the config alone: each refusal names the setting and the fix.

:func:`check_config` is cheap (it runs before the model, the data or the Trainer exist): the data/model pairing,
the optimizer's and the Trainer's numbers, interpolations, precision x strategy, the resume path's shape. What needs
the built objects is checked later: :mod:`lit_speed.run.model_checks` (the DataModule's tokens against the model,
activation memory), :mod:`lit_speed.run.resume_checks` (the checkpoint against the model and optimizer),
:mod:`lit_speed.run.memory_fit.fit_check` (the run's peak RSS), :class:`~lit_speed.run.plan_check.RunPlanCheck` (what only the
Trainer knows: batches per epoch).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf

from lit_speed.run.config_error import ConfigError
from lit_speed.run.file_checks import check_text_budget, check_weight_files
from lit_speed.run.resume_checks import check_checkpoint_path
from lit_speed.strategies.config_facts import ConfigFacts, config_facts


def _short(target: Any) -> str:
    return str(target).rsplit(".", 1)[-1]


def _data_target(data: DictConfig) -> Any:
    """The DataModule ``data`` builds; a wrapper (a curriculum's ``datamodule``) yields what it wraps."""
    inner = data.get("datamodule")
    if isinstance(inner, DictConfig) and "_target_" in inner:
        return inner._target_
    return data.get("_target_")


def _declared(target: Any, attribute: str) -> Any:
    """``target``'s class attribute ``attribute`` (``batch_kind``, ``accepted_batch_kinds``), imported; ``None``
    when it does not import or declares nothing (the pre-flight reports a target that does not import)."""
    from lit_speed.run.config_targets import import_target

    if not isinstance(target, str):
        return None
    try:
        return getattr(import_target(target, ""), attribute, None)
    except ConfigError:
        return None


def _pair_fixes(kind: str, accepted: tuple[str, ...], folders: Sequence[Path]) -> list[str]:
    """Options that fit: models that take ``kind``, data options that yield one of ``accepted``, and experiments
    that set a fitting data and model pair (``override /data`` and ``override /model`` in their defaults)."""
    from lit_speed.run.config_targets import option_targets

    models = option_targets("model", folders)
    datas = option_targets("data", folders)
    fixes = [f"model={o}" for o, cls in models.items() if kind in (getattr(cls, "accepted_batch_kinds", None) or ())]
    fixes += [f"data={o}" for o, cls in datas.items() if getattr(cls, "batch_kind", None) in accepted]
    for folder in folders:
        for path in sorted((folder / "experiment").glob("*.yaml")):
            chosen = {}
            for entry in OmegaConf.load(path).get("defaults") or []:
                if isinstance(entry, DictConfig):
                    chosen.update({str(k).split("/")[-1]: str(v) for k, v in entry.items()
                                   if str(k).startswith("override /")})
            data_cls, model_cls = datas.get(chosen.get("data", "")), models.get(chosen.get("model", ""))
            pair_kind = getattr(data_cls, "batch_kind", None)
            # a preset pair that keeps one side of the refused pair: the data's kind, or a model that takes it all
            keeps_one = pair_kind == kind or tuple(getattr(model_cls, "accepted_batch_kinds", None) or ()) == accepted
            if data_cls is not None and model_cls is not None and keeps_one and \
                    pair_kind in (getattr(model_cls, "accepted_batch_kinds", None) or ()):
                fixes.append(f"experiment={path.stem} (data={chosen['data']} model={chosen['model']})")
    return fixes


def check_data_model(cfg: DictConfig, folders: Sequence[Path] = ()) -> None:
    """Refuse a DataModule and a model that cannot work together (token ids into the MLP, digits into GPT), from
    what their classes declare (:class:`~lit_speed.run_contract.BatchSource`,
    :class:`~lit_speed.run_contract.BatchConsumer`); a class that declares nothing is not checked.

    Args:
        cfg: The composed config.
        folders: The config search path's folders, searched for options that fit (lit_speed's ``conf/`` if empty).

    Raises:
        ConfigError: Naming both classes, the batch kinds, and the options that fit.
    """
    data, model = cfg.get("data"), cfg.get("model")
    if not isinstance(data, DictConfig) or not isinstance(model, DictConfig):
        return
    data_target, model_target = _data_target(data), model.get("_target_")
    kind, accepted = _declared(data_target, "batch_kind"), _declared(model_target, "accepted_batch_kinds")
    if kind is None or accepted is None or kind in accepted:
        return
    from lit_speed.run.config_targets import CONFIG_DIR

    fixes = _pair_fixes(kind, tuple(accepted), list(folders) or [CONFIG_DIR])
    model_cls = _short(model_target)
    raise ConfigError(f"data ({_short(data_target)}) does not fit model ({model_cls}): it yields {kind!r} batches, "
                      f"{model_cls} takes {' or '.join(map(repr, accepted))}. "
                      f"Fix: {', or '.join(fixes) if fixes else 'a data= and model= pair that fit'}")


def _number(node: DictConfig, key: str, where: str) -> float | None:
    if key not in node or node[key] is None:
        return None
    value = node[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}.{key}={value!r}: expected a number, got {type(value).__name__}. "
                          f"Fix: {where}.{key}=<a number>")
    if not math.isfinite(value):
        raise ConfigError(f"{where}.{key}={value}: must be finite. Fix: {where}.{key}=<a finite number>")
    return float(value)


def check_optimizer(cfg: DictConfig) -> None:
    """lr > 0, 0 <= betas < 1 (two of them), eps > 0, weight_decay >= 0, momentum >= 0, each a finite number."""
    node = cfg.get("optimizer")
    if not isinstance(node, DictConfig):
        return
    lr = _number(node, "lr", "optimizer")
    if lr is not None and lr <= 0:
        raise ConfigError(f"optimizer.lr={node.lr}: the model would not train (lr must be > 0). "
                          "Fix: optimizer.lr=1e-3 (or another positive value)")
    for key, low in (("eps", None), ("weight_decay", 0.0), ("momentum", 0.0)):
        value = _number(node, key, "optimizer")
        if value is not None and (value < 0 if low == 0.0 else value <= 0):
            raise ConfigError(f"optimizer.{key}={node[key]}: must be {'>= 0' if low == 0.0 else '> 0'}. "
                              f"Fix: optimizer.{key}=<a {'non-negative' if low == 0.0 else 'positive'} number>")
    if "betas" in node and node.betas is not None:
        betas = OmegaConf.to_object(node.betas) if OmegaConf.is_list(node.betas) else node.betas
        if (not isinstance(betas, list) or len(betas) != 2
                or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)):
            raise ConfigError(f"optimizer.betas={betas!r}: needs two numbers in [0, 1). Fix: optimizer.betas=[0.9,0.99]")


def _positive(trainer: DictConfig, key: str, fix: str, allow_zero: bool = False) -> None:
    value = _number(trainer, key, "trainer")
    if value is not None and (value < 0 if allow_zero else value <= 0):
        raise ConfigError(f"trainer.{key}={trainer[key]}: {fix}")


def check_trainer(cfg: DictConfig) -> None:
    """Values the Trainer accepts but that divide by zero, clip nothing, or make no optimizer step."""
    trainer = cfg.get("trainer")
    if not isinstance(trainer, DictConfig):
        return
    _positive(trainer, "gradient_clip_val", "a negative clip value clips nothing. "
              "Fix: trainer.gradient_clip_val=1.0 (or null for no clipping)", allow_zero=True)
    _positive(trainer, "val_check_interval", "validation every 0 batches is undefined. "
              "Fix: trainer.val_check_interval=<batches >= 1, or a fraction of an epoch in (0, 1]>")
    _positive(trainer, "check_val_every_n_epoch", "must be >= 1. "
              "Fix: trainer.check_val_every_n_epoch=1 (or null to validate by trainer.val_check_interval)")
    for key, what in (("max_steps", "optimizer steps"), ("max_epochs", "epochs")):
        value = trainer.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value < -1:
            raise ConfigError(f"trainer.{key}={value}: a number of {what} >= 1, or -1 for no limit. "
                              f"Fix: trainer.{key}={-value} or trainer.{key}=-1")
    for key in ("max_steps", "max_epochs", "limit_train_batches"):
        if trainer.get(key) == 0 and not isinstance(trainer.get(key), bool):
            fix = {"max_steps": "trainer.max_steps=-1 (no step limit) or >= 1",
                   "max_epochs": "trainer.max_epochs=1 or more",
                   "limit_train_batches": "trainer.limit_train_batches=1.0 (all batches) or >= 1"}[key]
            raise ConfigError(f"trainer.{key}=0: the run would make no optimizer step. Fix: {fix}")


#: arguments of the adapters' callback checked before anything is built: its own constructor checks them, and a
#: refusal after the model is built would come after its weights load (minutes at 1B), or as the model's refusal
_ADAPTER_ARGUMENTS = ("method", "r", "alpha", "dropout", "base_dtype", "base_compute", "up_grad", "export_format")


def check_adapters(cfg: DictConfig, facts: ConfigFacts | None = None) -> None:
    """``peft.*`` values ``PEFTAdapters`` refuses (``base_dtype=int4``, ``alpha=-1``), refused from the config with
    the component's own message: ``peft.base_dtype`` also sets the model's ``load_dtype``, whose refusal would name
    ``model.pretrained``; and ``scripts/plan.py`` builds no callback at all."""
    node = (facts or config_facts(cfg)).adapters
    if node is None:
        return
    from lit_speed.finetune.peft_callback import PEFTAdapters
    from lit_speed.run.refusals import with_config_path

    try:
        PEFTAdapters(**{k: node[k] for k in _ADAPTER_ARGUMENTS if k in node}, export=False)
    except (ValueError, TypeError) as error:
        raise ConfigError(with_config_path(str(error), {"PEFTAdapters": "peft"}) or str(error)) from None


def check_interpolations(cfg: DictConfig) -> None:
    """Every ``${...}`` in the config points at a key that exists (``${hydra:...}``, known only inside the job, and
    values resolved through it are left to the job).

    Raises:
        ConfigError: Naming the key, its value and what it points at.
    """
    from omegaconf.errors import InterpolationKeyError, InterpolationResolutionError

    def walk(node: Any, path: str) -> None:
        keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
        for key in keys:
            where = f"{path}.{key}" if path else str(key)
            if where == "hydra" or where.startswith("hydra."):
                continue
            raw = OmegaConf.to_container(node, resolve=False)[key]  # type: ignore[index]
            if isinstance(raw, str) and "${hydra:" in raw:
                continue
            if raw == "???":  # a required value the option leaves to the command line (model.pretrained, init.path)
                raise ConfigError(f"{where}=???: required, and not given. Fix: {where}=<a value> on the command line "
                                  f"(see the comment of {path.split('.')[0] or where} in its conf/ file)")
            try:
                value = node[key]
            except InterpolationKeyError as error:
                missing = str(error).split("'")[1] if "'" in str(error) else str(error)
                raise ConfigError(f"{where}={raw}: the interpolation points at '{missing}', which the config does not "
                                  f"have. Fix: {where}=<a value>, or an interpolation of a key that exists") from None
            except InterpolationResolutionError:  # e.g. ${paths.output_dir} -> ${hydra:...}: resolved in the job
                continue
            if isinstance(value, (DictConfig, ListConfig)):
                walk(value, where)

    walk(cfg, "")


def check_precision_strategy(cfg: DictConfig, facts: ConfigFacts | None = None) -> None:
    """Refuse, before any process starts, a precision mode the configured strategy cannot run (bf16-master on
    several processes); ``GuardedPrecision`` would refuse it too, but only in every started process."""
    from lit_speed.precision.modes import TABLE, refused_processes

    facts = facts or config_facts(cfg)
    mode = facts.precision_mode if facts.precision_plugin else None
    if mode not in TABLE or not TABLE[mode].one_process:
        return
    strategy = facts.strategy
    if strategy.built and not strategy.classes:  # a target that does not import: the target check names it
        return
    world = facts.processes
    if refused_processes(str(mode), strategy.classes, world):
        name = strategy.name if strategy.built else "the default strategy"
        raise ConfigError(f"precision={mode} with {name} on {world or 'several'} processes: {mode} runs on "
                          "one process for now (its gradient hook moves each bf16 gradient into the float32 master "
                          "before DDP could all-reduce it). Fix: precision=bf16-mixed for multi-process runs, or "
                          "strategy=zero2 (DeepSpeed keeps float32 masters itself), or trainer.devices=1")


#: Callbacks that undo each other: (lit_speed class, lit_speed class, why). Both in one run is refused before
#: anything is built.
OPPOSED_CALLBACKS = (
    ("KeepFreedMemory", "ReturnFreedMemory",
     "one keeps freed memory in the process for speed, the other returns it to the system for memory"),
)


def check_callbacks(cfg: DictConfig, facts: ConfigFacts | None = None) -> None:
    """Refuse two callbacks that undo each other (:data:`OPPOSED_CALLBACKS`), naming both keys."""
    facts = facts or config_facts(cfg)
    for first, second, why in OPPOSED_CALLBACKS:
        firsts, seconds = facts.callback_keys(first), facts.callback_keys(second)
        if firsts and seconds:
            a, b = firsts[-1], seconds[-1]
            raise ConfigError(f"callbacks: {a} and {b} together: {why}. Fix: keep one "
                              f"(callbacks=[default,{a}] or callbacks=[default,{b}])")


def check_config(cfg: DictConfig, folders: Sequence[Path] = ()) -> None:
    """Every config-only check; raises :class:`ConfigError` on the first failure.

    ``folders``: the config search path's folders (``lit_speed.run.config_check.config_folders``), for the fixes.
    """
    check_data_model(cfg, folders)  # first: a model without its data also leaves ${data.*} interpolations dangling
    check_interpolations(cfg)
    facts = config_facts(cfg)
    check_precision_strategy(cfg, facts)
    seed = cfg.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ConfigError(f"seed={seed!r}: expected an integer or null. Fix: seed=42 (or seed=null for no seeding)")
    check_optimizer(cfg)
    check_trainer(cfg)
    check_callbacks(cfg, facts)
    check_adapters(cfg, facts)
    check_checkpoint_path(cfg.get("ckpt_path"))
    check_text_budget(cfg, facts)  # reads the first text files' sizes
    check_weight_files(cfg)  # reads the weight files' headers
