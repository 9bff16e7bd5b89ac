"""Catch bad command-line overrides before Hydra prints a stack trace: name the value and the choices."""
from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lit_speed.config_error import ConfigError  # re-exported: scripts import it from here

CONFIG_DIR = Path(__file__).resolve().parents[1] / "conf"


def group_options(group: str, config_dir: Path = CONFIG_DIR) -> list[str]:
    """Option names of a config group (``conf/<group>/*.yaml``)."""
    return sorted(p.stem for p in (config_dir / group).glob("*.yaml"))


def _first_value(override: str) -> str:
    """``a=1,2`` (a sweep) -> ``a=1``: a sweep is checked through its first value."""
    parsed = OverridesParser.create().parse_overrides([override])[0]
    if not parsed.is_sweep_override():
        return override
    first = next(iter(parsed.sweep_string_iterator()))
    prefix = {"ADD": "+", "FORCE_ADD": "++", "DEL": "~"}.get(parsed.type.name, "")
    return f"{prefix}{parsed.key_or_group}={first}"


def _explain(override: str, cfg_without: DictConfig | None, config_dir: Path) -> str:
    key, _, value = override.lstrip("+~").partition("=")
    if (config_dir / key).is_dir():
        choices = group_options(key, config_dir)
        near = difflib.get_close_matches(value, choices, n=1)
        hint = f" Did you mean {key}={near[0]}?" if near else ""
        return f"{key}={value}: unknown option {value!r} for group {key!r}. Valid choices: {', '.join(choices)}.{hint}"
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg_without, parent_key) if (cfg_without is not None and parent_key) else cfg_without
    if isinstance(parent, DictConfig):
        keys = [str(k) for k in parent.keys()]
        if leaf not in keys and parent_key and (config_dir / leaf).is_dir():  # trainer.precision: a group of its own
            choices = group_options(leaf, config_dir)
            fix = f"{leaf}={value}" if value in choices else f"{leaf}=<one of {', '.join(choices)}>"
            return (f"{key}={value}: {leaf} is chosen by its own config group, not under {parent_key!r} (lit_speed "
                    f"hands the {leaf} object to the Trainer). Fix: {fix}")
        if leaf not in keys:
            near = difflib.get_close_matches(leaf, keys, n=3)
            hint = f" Did you mean {' or '.join(f'{parent_key}.{n}' if parent_key else n for n in near)}?" if near else ""
            where = f"'{parent_key}'" if parent_key else "the top level"
            return (f"{key}={value}: no key {leaf!r} in {where}.{hint} Valid keys: {', '.join(keys)}. "
                    f"To add a new key on purpose, write +{key}={value}.")
    return ""


def value_matches(value: Any, annotation: Any) -> bool:
    """Whether a config value fits a type annotation (None, bool, int, float, str, Literal, Union, list, dict).

    Unknown annotations (classes, callables) accept anything: only what can be checked is refused.
    """
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return value is None
    if origin is typing.Union:
        return any(value_matches(value, a) for a in args)
    if origin is typing.Literal:
        return value in args and type(value) in {type(a) for a in args}
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin in (list, tuple) or annotation in (list, tuple):
        return isinstance(value, (list, tuple, ListConfig))
    if origin is dict or annotation is dict:
        return isinstance(value, (dict, DictConfig))
    return True


def _describe_annotation(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is typing.Union:
        return " or ".join(dict.fromkeys(_describe_annotation(a) for a in args))
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    return getattr(annotation, "__name__", str(annotation))


def check_trainer_types(cfg: DictConfig, group: str = "trainer") -> None:
    """Refuse ``<group>.*`` values whose type the ``_target_``'s constructor does not accept (``max_epochs=abc``)."""
    node = OmegaConf.select(cfg, group)
    if not isinstance(node, DictConfig) or "_target_" not in node:
        return
    import hydra.utils

    try:
        hints = typing.get_type_hints(hydra.utils.get_class(node._target_).__init__)
    except Exception:  # an unimportable target or unresolvable hints: instantiation reports it
        return
    owner = "Trainer" if group == "trainer" else node._target_.rsplit(".", 1)[-1]
    for key in node:
        if key == "_target_" or key not in hints or OmegaConf.is_interpolation(node, key) \
                or OmegaConf.is_missing(node, key):  # ??? is check_interpolations' to name
            continue
        value = OmegaConf.to_object(node[key]) if isinstance(node[key], (DictConfig, ListConfig)) else node[key]
        if isinstance(value, dict) and "_target_" in value:
            continue  # an object Hydra builds (a timedelta, a profiler): its constructor checks it
        if not value_matches(value, hints[key]):
            raise ConfigError(f"{group}.{key}={value!r}: {owner} expects {_describe_annotation(hints[key])}, "
                              f"got {type(value).__name__}. Fix: {group}.{key}=<a value of that type>")


def check_output_dirs(argv: list[str]) -> None:
    """``hydra.run.dir=`` / ``hydra.sweep.dir=`` given on the command line can be created (Hydra creates them first
    thing, and a folder it cannot create ends in a traceback). Values with ``${...}`` are left to Hydra."""
    import os

    for arg in argv:
        key, _, value = arg.lstrip("+~").partition("=")
        if key not in ("hydra.run.dir", "hydra.sweep.dir") or not value or "${" in value:
            continue
        path = Path(value).expanduser()
        existing = next((p for p in (path, *path.parents) if p.exists()), None)
        try:
            if existing is not None and not existing.is_dir():
                raise NotADirectoryError(f"{existing} is a file")
            path.mkdir(parents=True, exist_ok=True)  # what Hydra does next; an empty folder is all it leaves
            if not os.access(path, os.W_OK):
                raise PermissionError(f"{path} is not writable")
        except OSError as error:
            reason = error.strerror or str(error)
            raise ConfigError(f"{key}={value}: the run folder cannot be created or written ({reason}). Fix: "
                              f"{key}=<a folder you can write to>, e.g. {key}=logs/my_run") from None


def preflight(argv: list[str], config_name: str = "train", config_dir: Path = CONFIG_DIR) -> DictConfig:
    """Compose the config the way ``scripts/train.py`` will; raise :class:`ConfigError` with a fix on failure.

    Only plain overrides are checked (``hydra.*`` settings and flags are Hydra's own business).
    """
    check_output_dirs(argv)
    overrides = [a for a in argv if "=" in a and not a.startswith("-") and not a.lstrip("+~").startswith("hydra")]
    from lit_speed.run_checks import check_config  # imported on use: it loads torch

    firsts = []
    for override in overrides:
        try:
            firsts.append(_first_value(override))
        except HydraException as error:  # unbalanced brackets or quotes: the override does not parse
            reason = " ".join(str(error).split())
            raise ConfigError(f"{override}: not a valid override ({reason[:160]}). Fix: balance its brackets and "
                              "quotes, e.g. key=[1,2] or key='a b'") from None
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        try:
            cfg = compose(config_name=config_name, overrides=firsts)
        except (HydraException, OmegaConfBaseException, ValueError) as error:
            original = str(error).strip()
        else:
            for group in ("trainer", "data", "data.datamodule", "model"):
                check_trainer_types(cfg, group)
            check_config(cfg)
            return cfg
        # find the override to blame: the first whose removal makes composition succeed
        for i, override in enumerate(firsts):
            rest = firsts[:i] + firsts[i + 1:]
            try:
                cfg_without = compose(config_name=config_name, overrides=rest)
            except (HydraException, OmegaConfBaseException, ValueError):
                continue
            message = _explain(override, cfg_without, config_dir)
            raise ConfigError(message or f"{overrides[i]}: {original}") from None
        raise ConfigError(original) from None
