"""The config search path's option files and the objects their ``_target_`` names; every ``_target_`` of a composed
config imports and takes the keys the config gives it, and no key is ignored.

A preset written for one option keeps its keys when the user switches the option (``experiment=charlm_fast
optimizer=adamw`` keeps Muon's ``adamw_lr``): Hydra composes it, and the constructor fails only when the object is
built, for a ``_partial_`` optimizer as late as the first training batch. :func:`check_targets` refuses it before
anything is built, in one line naming the key, the class, and the fix (drop the key, or the option that takes it).
"""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Callable, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf

from lit_speed.run.config_error import ConfigError
from lit_speed.strategies.config_facts import locate

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / "conf"  # lit_speed's own config groups

#: Groups whose nodes the runner builds as one ``_target_`` or a dict of them; anything else in them is not built.
BUILT_GROUPS = ("callbacks", "accumulation", "logger")


def group_options(group: str, config_dir: Path = CONFIG_DIR) -> list[str]:
    """Option names of a config group (``<config_dir>/<group>/*.yaml``)."""
    return sorted(p.stem for p in (config_dir / group).glob("*.yaml"))


def config_folders(cfg: DictConfig | None) -> list[Path]:
    """The file-system folders of a composed config's search path (``hydra.runtime.config_sources``), in order;
    lit_speed's ``conf/`` when ``cfg`` carries no Hydra node."""
    sources = OmegaConf.select(cfg, "hydra.runtime.config_sources") if cfg is not None else None
    if not sources:
        return [CONFIG_DIR]
    return [Path(s.path).resolve() for s in sources if s.schema == "file"]


def import_target(target: str, where: str) -> Any:
    """The object ``target`` names (``pkg.module.Class``), imported as Hydra imports it.

    Raises:
        ConfigError: If it does not import, naming the module that is missing and how to make it importable.
    """
    try:
        return locate(target)
    except Exception as error:  # noqa: BLE001 - ModuleNotFoundError, AttributeError, or whatever the module raises
        missing = error.name if isinstance(error, ModuleNotFoundError) else None
        reason = f"no module named {missing!r}" if missing else f"{type(error).__name__}: {str(error).splitlines()[0]}"
        package = (missing or target).split(".")[0]
        raise ConfigError(f"{where}._target_={target}: cannot import it ({reason}). Fix: make your package importable "
                          f"where the run starts: pip install -e <your project>, or PYTHONPATH=<the folder that holds "
                          f"{package}/> python scripts/train.py ...") from None


def accepted_keys(obj: Callable[..., Any]) -> set[str] | None:
    """Keyword arguments ``obj`` (a class or a function) accepts; ``None`` when it takes ``**kwargs`` or has no
    signature Python can read."""
    try:
        parameters = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters if p.kind is not inspect.Parameter.POSITIONAL_ONLY}


def _file_target(path: Path, folders: Sequence[Path], group: str) -> Any:
    """The ``_target_`` an option file names, itself or through the configs its defaults list composes first (a base
    in ``conf/base/``, ``/base/<name>@_here_``, or another option of the group)."""
    node = OmegaConf.load(path)
    if "_target_" in node:
        return node.get("_target_")
    for entry in node.get("defaults") or []:
        if not isinstance(entry, str) or entry == "_self_" or "@" in entry and not entry.endswith("@_here_"):
            continue
        name = entry.split("@")[0]
        relative = name.lstrip("/") if name.startswith("/") else f"{group}/{name}"
        for folder in folders:
            if (folder / f"{relative}.yaml").is_file():
                return _file_target(folder / f"{relative}.yaml", folders, relative.rsplit("/", 1)[0])
    return None


def option_targets(group: str, folders: Sequence[Path]) -> dict[str, Any]:
    """``{option: the object its _target_ names}`` for the options of ``group`` on the search path whose file (or
    the base it composes from) names a ``_target_`` that imports (the first folder that has an option wins, as in
    Hydra)."""
    found: dict[str, Any] = {}
    for folder in folders:
        for path in sorted((folder / group).glob("*.yaml")):
            target = _file_target(path, [*folders, CONFIG_DIR], group)
            if path.stem in found or not isinstance(target, str):
                continue
            try:
                found[path.stem] = import_target(target, group)
            except ConfigError:
                continue
    return found


def _options_taking(group: str, key: str, folders: Sequence[Path]) -> list[str]:
    """Options of ``group`` whose target accepts ``key``."""
    return sorted(option for option, obj in option_targets(group, folders).items()
                  if key in (accepted_keys(obj) or ()))


def check_target_node(node: DictConfig, where: str, folders: Sequence[Path] = ()) -> None:
    """The ``_target_`` of ``node`` (at config path ``where``) imports and accepts every key ``node`` sets.

    Raises:
        ConfigError: Naming the first key the target does not take, and the fix.
    """
    target = node._target_
    keys = accepted_keys(import_target(target, where))
    if keys is None:
        return
    raw = OmegaConf.to_container(node, resolve=False)
    unknown = [str(key) for key in raw if not str(key).startswith("_") and str(key) not in keys]
    if not unknown:
        return
    name = target.rsplit(".", 1)[-1]
    group = where.split(".", 1)[0]
    taking = [set(_options_taking(group, key, folders)) for key in unknown] if "." not in where else []
    others = sorted(set.intersection(*taking)) if taking else []
    one = len(unknown) == 1
    alternative = f", or {group}=<{' | '.join(others)}> (takes {'it' if one else 'them'})" if others else ""
    shown = ", ".join(sorted(k for k in keys if k not in ("self", "params")))
    kept = (f" (the preset's other {group} settings, e.g. its lr, stay: check them)"
            if group == "optimizer" else "")
    settings = ", ".join(f"{where}.{key}={raw[key]}" for key in unknown)
    args = f"argument {unknown[0]!r}" if one else f"arguments {', '.join(map(repr, unknown))}"
    drops = " ".join(f"~{where}.{key}" for key in unknown)
    raise ConfigError(f"{settings}: {name} takes no {args} (it takes: {shown}); a preset or the option whose "
                      f"_target_ was replaced sets {'it' if one else 'them'}. Fix: {drops} to drop "
                      f"{'it' if one else 'them'}{kept}{alternative}")


def check_built_groups(cfg: DictConfig, folders: Sequence[Path] = ()) -> None:
    """Keys under ``callbacks``, ``accumulation`` and ``logger`` that no ``_target_`` would build are refused
    (``experiment=charlm_fast accumulation=none`` keeps the preset's ``accumulation.effective_batch``).

    Raises:
        ConfigError: Naming the keys, the option that builds nothing from them, and the fix.
    """
    for group in BUILT_GROUPS:
        node = cfg.get(group)
        if not isinstance(node, DictConfig) or "_target_" in node:
            continue
        raw = OmegaConf.to_container(node, resolve=False)
        loose = [str(k) for k, v in raw.items() if v is not None and not (isinstance(v, dict) and ("_target_" in v or not v))]
        if loose:
            drops = " ".join(f"~{group}.{k}" for k in loose)
            takers = sorted(set.intersection(*(set(_options_taking(group, k, folders)) for k in loose)))
            option = f"{group}=<{' | '.join(takers)}> (they take them)" if takers else f"the {group}= option they belong to"
            raise ConfigError(f"{group}.{loose[0]}={raw[loose[0]]}: nothing in {group} builds from "
                              f"{', '.join(loose)} (no _target_: a preset or file sets them for another {group} "
                              f"option), so they would be ignored. Fix: {option}, or drop them: {drops}")


def check_targets(cfg: DictConfig, folders: Sequence[Path] = ()) -> None:
    """:func:`check_target_node` on every ``_target_`` node of ``cfg`` (``hydra`` excluded), then
    :func:`check_built_groups`.

    Args:
        cfg: The composed config.
        folders: The config search path's folders, searched for an option that takes a refused key.
    """
    def walk(node: Any, where: str) -> None:
        if isinstance(node, DictConfig):
            if isinstance(node.get("_target_"), str):
                check_target_node(node, where, folders)
            for key, child in node.items_ex(resolve=False):
                if not (where == "" and key == "hydra"):
                    walk(child, f"{where}.{key}" if where else str(key))
        elif isinstance(node, ListConfig):
            for i, child in enumerate(node):
                walk(child, f"{where}[{i}]")

    walk(cfg, "")
    check_built_groups(cfg, folders)


def model_takes_optimizer(model: DictConfig) -> bool:
    """Whether the runner hands the ``optimizer`` group to the model: its class takes an ``optimizer`` argument
    (or ``**kwargs``) and its config does not set one of its own (a lightning-hydra-template ``model.optimizer``)."""
    if "optimizer" in model or not isinstance(model.get("_target_"), str):
        return False
    try:
        keys = accepted_keys(import_target(model._target_, "model"))
    except ConfigError:
        return True  # instantiation reports it
    return keys is None or "optimizer" in keys


def check_optimizer_choice(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """An ``optimizer=`` given on the command line reaches the model, or is refused (never silently unused).

    Raises:
        ConfigError: Naming the option, why the model does not take it, and the fix.
    """
    chosen = next((o for o in overrides if o.lstrip("+").partition("=")[0] == "optimizer"), None)
    model = cfg.get("model")
    if chosen is None or not isinstance(model, DictConfig) or model_takes_optimizer(model):
        return
    name = str(model.get("_target_", "the model")).rsplit(".", 1)[-1]
    why, fix = (("its config sets model.optimizer, which wins", f"drop {chosen} (model.optimizer is used), or "
                 f"~model.optimizer {chosen} to use it")
                if "optimizer" in model else
                (f"{name} takes no `optimizer` argument (its configure_optimizers builds its own)",
                 f"drop {chosen}, or give {name} an `optimizer` argument (a factory: params -> Optimizer)"))
    raise ConfigError(f"{chosen}: the model would not use it: {why}. Fix: {fix}")
