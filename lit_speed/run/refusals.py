"""A component's refusal, before training, as one ``Config error:`` line that starts with the config path of the
setting it refuses (``AccumulationScheduler(micro_batch=0): ...`` from ``accumulation`` becomes
``accumulation.micro_batch=0: AccumulationScheduler(micro_batch=0): ...``)."""
from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from hydra.errors import InstantiationException
from lightning.fabric.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, OmegaConf

from lit_speed.run.config_error import ConfigError

# a reusable class names itself and the argument it refuses: "AccumulationScheduler(micro_batch=0): ..."
_CLASS_AND_ARGUMENT = re.compile(r"^(?P<cls>[A-Za-z_]\w*)(?:\((?P<arg>\w+)=(?P<value>.*?)\))?: ")


def config_paths(cfg: DictConfig) -> dict[str, str]:
    """``{class name: config path}`` of every ``_target_`` node in ``cfg`` (the first path wins)."""
    paths: dict[str, str] = {}

    def walk(node: Any, path: str) -> None:
        if not isinstance(node, dict):
            return
        target = node.get("_target_")
        if isinstance(target, str) and path:
            paths.setdefault(target.rsplit(".", 1)[-1], path)
        for key, child in node.items():
            walk(child, f"{path}.{key}" if path else str(key))

    walk(OmegaConf.to_container(cfg, resolve=False), "")
    return paths


def with_config_path(message: str, paths: dict[str, str]) -> str | None:
    """``message`` prefixed with the config path of the class and argument it names, or None if it names none.

    ``"AccumulationScheduler(micro_batch=0): ..."`` from the node at ``accumulation`` becomes
    ``"accumulation.micro_batch=0: AccumulationScheduler(micro_batch=0): ..."``.
    """
    found = _CLASS_AND_ARGUMENT.match(message)
    where = paths.get(found["cls"]) if found else None
    if where is None:
        return None
    return f"{where}.{found['arg']}={found['value']}: {message}" if found["arg"] else f"{where}: {message}"


def _config_error(error: BaseException, paths: dict[str, str]) -> ConfigError:
    message = str(error)
    if getattr(error, "names_its_setting", False):  # e.g. "data.source: train.jsonl line 3 is ...": as it is
        return ConfigError(message)
    return ConfigError(with_config_path(message, paths) or f"{type(error).__name__}: {message}")


@contextmanager
def refusals_as_config_errors(before_training: Callable[[], bool], paths: dict[str, str]) -> Iterator[None]:
    """Turn a component's refusal (ValueError, Lightning's MisconfigurationException, a missing file) into
    :class:`ConfigError` with the component's own message, as long as no training batch has run.

    The message starts with the config path of the setting it refuses (``paths``: see :func:`config_paths`)
    when the component names its class and argument, or is left as it is when the error says it names its setting
    (``names_its_setting = True``); Hydra's ``InstantiationException`` wrapper is removed.
    """
    try:
        yield
    except ConfigError:
        raise
    except InstantiationException as error:
        cause = error
        while isinstance(cause, InstantiationException) and cause.__cause__ is not None:
            cause = cause.__cause__
        raise _config_error(cause, paths) from error
    except (ValueError, MisconfigurationException, FileNotFoundError) as error:
        if not before_training():
            raise
        raise _config_error(error, paths) from error
