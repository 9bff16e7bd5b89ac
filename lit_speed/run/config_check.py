"""Catch bad command-line overrides before Hydra prints a stack trace: name the value and the choices.

The pre-flight composes from the folders Hydra will search (:mod:`lit_speed.compat.hydra`): lit_speed's ``conf/``
(or ``--config-path``), ``--config-dir`` and ``hydra.searchpath``, so a user's own config groups pass it and a typo
in one is named with the user's options beside lit_speed's.
"""
from __future__ import annotations

import copy
import difflib
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml
from hydra import compose
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from lit_speed.compat.hydra import initialized_like_main, parse_command_line
from lit_speed.run.config_error import ConfigError
from lit_speed.run.config_targets import CONFIG_DIR, ROOT, config_folders, group_options

ENTRY = ROOT / "scripts" / "train.py"  # declares @hydra.main(config_path="../conf", config_name="train")


def options_by_folder(group: str, folders: Sequence[Path]) -> dict[str, list[str]]:
    """``{folder: options}`` of a config group in each folder that has it (``<folder>/<group>/*.yaml``)."""
    found = {str(folder): group_options(group, folder) for folder in folders}
    return {folder: options for folder, options in found.items() if options}


def _choices(group: str, folders: Sequence[Path]) -> tuple[list[str], str]:
    """Every option of ``group`` on the search path, and a note naming the ones outside lit_speed's ``conf/``."""
    by_folder = options_by_folder(group, folders)
    choices = sorted({o for options in by_folder.values() for o in options})
    own = [f"{', '.join(options)} from {folder}" for folder, options in by_folder.items()
           if Path(folder) != CONFIG_DIR.resolve()]
    return choices, f" (yours: {'; '.join(own)})" if own else ""


def _first_value(override: str) -> str:
    """``a=1,2`` (a sweep) -> ``a=1``: a sweep is checked through its first value."""
    parsed = OverridesParser.create().parse_overrides([override])[0]
    if not parsed.is_sweep_override():
        return override
    first = next(iter(parsed.sweep_string_iterator()))
    prefix = {"ADD": "+", "FORCE_ADD": "++", "DEL": "~"}.get(parsed.type.name, "")
    return f"{prefix}{parsed.key_or_group}={first}"


def _explain(override: str, cfg_without: DictConfig | None, folders: Sequence[Path]) -> str:
    key, _, value = override.lstrip("+~").partition("=")
    choices, own = _choices(key, folders)
    if choices:
        near = difflib.get_close_matches(value, choices, n=1)
        hint = f" Did you mean {key}={near[0]}?" if near else ""
        return (f"{key}={value}: unknown option {value!r} for group {key!r}. Valid choices: {', '.join(choices)}"
                f"{own}.{hint}")
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg_without, parent_key) if (cfg_without is not None and parent_key) else cfg_without
    if parent is None and parent_key and cfg_without is not None:  # validation_budget.max_fraction: a nested key
        home = _nested_home(key, value, cfg_without, folders)
        if home:
            return home
    if isinstance(parent, DictConfig):
        keys = [str(k) for k in parent.keys() if k != "hydra"]
        leaf_choices = _choices(leaf, folders)[0] if parent_key else []
        if leaf not in keys and leaf_choices:  # trainer.precision: a group of its own
            fix = f"{leaf}={value}" if value in leaf_choices else f"{leaf}=<one of {', '.join(leaf_choices)}>"
            return (f"{key}={value}: {leaf} is chosen by its own config group, not under {parent_key!r} (lit_speed "
                    f"hands the {leaf} object to the Trainer). Fix: {fix}")
        if leaf not in keys:
            near = difflib.get_close_matches(leaf, keys, n=3)
            groups = [n for n in near if not parent_key and _choices(n, folders)[0]]
            if groups:  # modle=regr: a misspelt config group
                hint = f" Did you mean {groups[0]}={value}?"
            else:
                hint = f" Did you mean {' or '.join(f'{parent_key}.{n}' if parent_key else n for n in near)}?" \
                    if near else ""
            where = f"'{parent_key}'" if parent_key else "the top level"
            return (f"{key}={value}: no key {leaf!r} in {where}.{hint} Valid keys: {', '.join(keys)}. "
                    f"To add a new key on purpose, write +{key}={value}.")
    return ""


def _nested_home(key: str, value: str, cfg: DictConfig, folders: Sequence[Path]) -> str:
    """Where a key given from the top level lives: under a group (``callbacks.validation_budget.max_fraction``), in
    the composed config or in an option file of that name; ``""`` when nowhere."""
    first, _, rest = key.partition(".")
    found: list[str] = []

    def walk(node: Any, path: str) -> None:
        for child_key, child in node.items_ex(resolve=False):
            where = f"{path}.{child_key}" if path else str(child_key)
            if where == "hydra" or not isinstance(child, DictConfig):
                continue
            if child_key == first and path and OmegaConf.select(child, rest) is not None:
                found.append(f"{where}.{rest}")
            walk(child, where)

    walk(cfg, "")
    if found:
        return (f"{key}={value}: no key {first!r} at the top level; it is {' and '.join(found)}. "
                f"Fix: {found[0]}={value}")
    choices = OmegaConf.select(cfg, "hydra.runtime.choices") or {}
    for folder in folders:
        for path in sorted(folder.glob(f"*/{first}.yaml")):
            group = path.parent.name
            try:
                node = OmegaConf.load(path)
            except Exception:  # noqa: BLE001 - an unreadable option file: not a home to suggest
                continue
            current = choices.get(group)
            if OmegaConf.select(node, key) is not None:  # a callbacks-style file that nests under its own name
                chosen = f"[{current},{first}]" if current else f"[<your {group} list>,{first}]"
                return (f"{key}={value}: no key {first!r} at the top level; it is {group}.{key}, which the {group} "
                        f"option {first} adds. Fix: '{group}={chosen}' {group}.{key}={value}")
            if OmegaConf.select(node, rest) is not None:  # lora.r=4: an option of the peft group
                return (f"{key}={value}: no key {first!r} at the top level; {first} is an option of the {group} "
                        f"group. Fix: {group}={first} {group}.{rest}={value}")
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


def _run_dir_value(arg: str) -> tuple[str, str] | None:
    """``(key, value)`` of a ``hydra.run.dir=`` / ``hydra.sweep.dir=`` override as Hydra reads it: unquoted
    (Lightning's launcher passes ``hydra.run.dir="<dir>"`` to the processes it starts), ``None`` for other overrides,
    sweeps, interpolations and text that does not parse (the pre-flight's parse names that)."""
    if not arg.lstrip("+~").startswith(("hydra.run.dir=", "hydra.sweep.dir=")):
        return None
    try:
        parsed = OverridesParser.create().parse_overrides([arg])[0]
    except HydraException:
        return None
    value = parsed.value()
    if parsed.is_sweep_override() or not isinstance(value, str) or not value or "${" in value:
        return None
    return parsed.key_or_group, value


def check_output_dirs(argv: list[str]) -> None:
    """``hydra.run.dir=`` / ``hydra.sweep.dir=`` given on the command line can be created (Hydra creates them first
    thing, and a folder it cannot create ends in a traceback). Values with ``${...}`` are left to Hydra; quotes are
    read as Hydra reads them (a quoted value once made a folder named ``"`` in the current folder)."""
    import os

    for arg in argv:
        found = _run_dir_value(arg)
        if found is None:
            continue
        key, value = found
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


def _without_hydra(cfg: DictConfig) -> DictConfig:
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


@dataclass(frozen=True)
class CommandLine:
    """A ``scripts/train.py`` command line as the pre-flight reads it (:func:`read_command_line`).

    ``overrides``: the ``key=value`` overrides but Hydra's own; ``firsts``: the same with each sweep at its first
    value; ``searchpath``: ``hydra.searchpath`` overrides; ``multirun``: ``-m``/``--multirun`` was given."""

    config_name: str
    config_path: str
    config_dir: str | None
    overrides: list[str]
    firsts: list[str]
    searchpath: list[str]
    multirun: bool


def read_command_line(argv: Sequence[str], config_name: str = "train", config_dir: Path = CONFIG_DIR) -> CommandLine:
    """The checks of a command line that need no composition: the run folders, the arguments Hydra refuses, overrides
    that do not parse, a ``--config-dir`` that is not a folder.

    Raises:
        ConfigError: Naming the argument and the fix.
    """
    check_output_dirs(list(argv))
    args, unrecognized = parse_command_line(argv)
    if unrecognized:
        flags = " ".join(a for a in argv if a.startswith("-") or a not in args.overrides + unrecognized)
        overrides = " ".join(a for a in argv if a in args.overrides + unrecognized and not a.startswith("-"))
        raise ConfigError(f"{' '.join(unrecognized)}: Hydra refuses it (unrecognized arguments): it reads key=value "
                          f"overrides in one run, not on both sides of a flag. Fix: python scripts/train.py {flags} "
                          f"{overrides}")
    searchpath = [a for a in args.overrides if a.lstrip("+~").partition("=")[0] == "hydra.searchpath"]
    overrides = [a for a in args.overrides if ("=" in a or a.startswith("~")) and not a.lstrip("+~").startswith("hydra")]
    firsts = []
    for override in overrides:
        try:
            firsts.append(_first_value(override))
        except HydraException as error:  # unbalanced brackets or quotes: the override does not parse
            reason = " ".join(str(error).split())
            raise ConfigError(f"{override}: not a valid override ({reason[:160]}). Fix: balance its brackets and "
                              "quotes, e.g. key=[1,2] or key='a b'") from None
    if args.config_dir is not None and not Path(args.config_dir).is_dir():
        raise ConfigError(f"--config-dir {args.config_dir}: no such folder ({Path(args.config_dir).resolve()}). Fix: "
                          "--config-dir <the folder that holds your config groups, e.g. my_conf with "
                          "my_conf/model/mine.yaml>")
    return CommandLine(args.config_name or config_name, args.config_path or str(config_dir), args.config_dir,
                       overrides, firsts, searchpath, bool(args.multirun))


def preflight(argv: Sequence[str], config_name: str = "train", config_dir: Path = CONFIG_DIR) -> DictConfig:
    """Compose the config the way ``scripts/train.py`` will and check it; raise :class:`ConfigError` with a fix on
    failure. Returns the composed config without its ``hydra`` node (``scripts/plan.py`` plans it).

    Hydra's own flags are read as Hydra reads them: ``--config-path``/``--config-name`` replace the main folder and
    the primary config, ``--config-dir`` adds a folder, a ``hydra.searchpath=[...]`` override adds folders. Other
    ``hydra.*`` settings and flags are Hydra's own business.

    Args:
        argv: The command line after the script name.
        config_name: The primary config when no ``--config-name`` is given.
        config_dir: The main config folder when no ``--config-path`` is given.
    """
    command = read_command_line(argv, config_name, config_dir)
    with initialized_like_main(str(ENTRY), command.config_path, command.config_dir):
        try:
            cfg = _compose(command, command.firsts)
        except yaml.YAMLError as error:  # a config file of the search path (the user's own, usually) does not parse
            raise ConfigError(_invalid_yaml(error, command.firsts)) from None
        except (HydraException, OmegaConfBaseException, ValueError) as error:
            raise _blame(command, str(error).strip()) from None
        return check_composed(cfg, command.firsts)


def explain_composition_error(command: CommandLine) -> ConfigError | None:
    """What the pre-flight says of a command line whose composition failed (``@hydra.main``'s, in
    ``scripts/train.py``): composed again the pre-flight's way, the override to blame and why; ``None`` when the
    overrides' first values compose (a sweep in a single run, a ``hydra.*`` setting): Hydra's own message says it."""
    with initialized_like_main(str(ENTRY), command.config_path, command.config_dir):
        try:
            _compose(command, command.firsts)
        except yaml.YAMLError as error:
            return ConfigError(_invalid_yaml(error, command.firsts))
        except (HydraException, OmegaConfBaseException, ValueError) as error:
            return _blame(command, str(error).strip())
    return None


def _compose(command: CommandLine, chosen: list[str]) -> DictConfig:
    """The composition (Hydra initialised) of ``chosen`` overrides and the search path's."""
    return compose(config_name=command.config_name, overrides=chosen + command.searchpath, return_hydra_config=True)


def check_composed(cfg: DictConfig, firsts: Sequence[str]) -> DictConfig:
    """Every check of a composed config (with its ``hydra`` node, which names the search path's folders), in the
    pre-flight's order; returns the config without the ``hydra`` node (a copy: ``cfg`` is left as given).

    Args:
        cfg: The composition (``compose(..., return_hydra_config=True)``, or the one ``@hydra.main`` makes).
        firsts: The command line's overrides, sweeps at their first value (``optimizer=`` is checked against them).
    """
    from lit_speed.run.config_rules import check_config  # imported on use: it loads torch
    from lit_speed.run.config_targets import check_optimizer_choice, check_targets

    folders = config_folders(cfg)
    cfg = _without_hydra(copy.deepcopy(cfg))
    check_targets(cfg, folders)
    check_optimizer_choice(cfg, list(firsts))
    for group in ("trainer", "data", "data.datamodule", "model"):
        check_trainer_types(cfg, group)
    check_config(cfg, folders)
    return cfg


def _blame(command: CommandLine, original: str) -> ConfigError:
    """Blame the first override whose removal makes composition succeed; with two bad ones, the first that fails on
    top of the ones before it (Hydra initialised)."""
    firsts, overrides = command.firsts, command.overrides

    def composed(chosen: list[str]) -> DictConfig:
        return _compose(command, chosen)

    candidates = [(i, firsts[:i] + firsts[i + 1:]) for i in range(len(firsts))]
    candidates += [(i, firsts[:i]) for i in range(len(firsts))]
    for i, rest in candidates:
        try:
            cfg_without = composed(rest)
        except (HydraException, OmegaConfBaseException, ValueError):
            continue
        if rest == firsts[:i] and _composes(composed, firsts[:i + 1]):
            continue
        message = _explain(firsts[i], cfg_without, config_folders(cfg_without))
        return ConfigError(message or f"{overrides[i]}: {' '.join(original.split())}")
    return ConfigError(original)


def _invalid_yaml(error: yaml.YAMLError, overrides: Sequence[str]) -> str:
    """One line for a config file that is not YAML: the option that selects it, the file, the line, and the fix."""
    mark = getattr(error, "problem_mark", None)
    problem = " ".join(str(getattr(error, "problem", None) or error).split())
    where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    context, start = getattr(error, "context", None), getattr(error, "context_mark", None)
    if context and start is not None and mark is not None and start.line != mark.line:  # an unclosed [ or {
        where += f"; {context} from line {start.line + 1}"
    path = Path(mark.name) if mark is not None and mark.name and not mark.name.startswith("<") else None
    chosen = None
    if path is not None:  # <folder>/<group>/<option>.yaml is selected by group=option
        for override in overrides:
            key, _, value = override.lstrip("+~").partition("=")
            if path.stem == value and path.parent.name == key.rsplit("/", 1)[-1]:
                chosen = override
    where_file = str(path) if path is not None else "a config file"
    return (f"{chosen + ': ' if chosen else ''}{where_file} is not valid YAML ({problem}{where}). Fix: correct that "
            "line of the file (YAML: `key: value` per line, lists [a, b], nesting by indentation; quote values that "
            "hold ': ' or ' #')")


def _composes(composed: Any, overrides: list[str]) -> bool:
    try:
        composed(overrides)
    except (HydraException, OmegaConfBaseException, ValueError):
        return False
    return True
