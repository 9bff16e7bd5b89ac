"""The metric a run follows (best checkpoint, summary, sweeps) when neither ``monitor=`` nor the model names one.

In order: ``monitor=`` / ``monitor_mode=``; the model's own (:class:`~lit_speed.run_contract.MonitoredModel`); a
``monitor`` the user's own callback config names (a lightning-hydra-template ``callbacks.model_checkpoint.monitor:
val/acc``); else the metrics the first validation logs (:func:`choose_monitor`), announced in one line and handed to
every :class:`~lit_speed.run_contract.MonitorFollower` among the callbacks before they read it.
"""
from __future__ import annotations

import re
from typing import Iterable

from omegaconf import DictConfig, OmegaConf

#: Name parts of metrics where lower is better, and where higher is better (matched as substrings of a part).
LOWER_IS_BETTER = ("loss", "err", "mse", "mae", "nll", "perplexity", "ppl", "bpc", "bpd", "wer", "cer", "dist")
HIGHER_IS_BETTER = ("acc", "f1", "auc", "precision", "recall", "iou", "dice", "bleu", "rouge", "score", "r2", "map",
                    "corr")


def _parts(name: str) -> list[str]:
    return [p for p in re.split(r"[/_.\-]", name.lower()) if p]


def mode_of(name: str) -> str | None:
    """``"min"`` for a loss or an error, ``"max"`` for an accuracy or a score, ``None`` when the name does not say."""
    parts = _parts(name)
    if any(word in part for part in parts for word in LOWER_IS_BETTER):
        return "min"
    if any(word in part for part in parts for word in HIGHER_IS_BETTER):
        return "max"
    return None


def is_validation_metric(name: str) -> bool:
    """``val/loss``, ``val_acc``, ``loss/valid``: a name with a ``val``/``valid``/``validation`` part."""
    return not name.endswith(("_step", "_epoch")) and any(p in ("val", "valid", "validation") for p in _parts(name))


def choose_monitor(logged: Iterable[str]) -> tuple[str, str] | None:
    """The validation metric to follow among ``logged`` names, and its mode: a loss first, then a metric whose name
    says its direction, then the first; ``None`` when no validation metric was logged.

    Example::

        choose_monitor(["train/loss", "val/acc", "val/loss"])  # ("val/loss", "min")
    """
    names = sorted(n for n in logged if is_validation_metric(n))
    if not names:
        return None
    losses = [n for n in names if any("loss" in p for p in _parts(n))]
    known = [n for n in names if mode_of(n) is not None]
    name = (losses or known or names)[0]
    return name, mode_of(name) or "min"


def configured_monitor(cfg: DictConfig) -> tuple[str, str] | None:
    """A ``monitor`` the user's callback configs name literally (not ``${monitor}``), with its ``mode`` (or the
    name's direction); ``None`` when none does."""
    callbacks = cfg.get("callbacks")
    if not isinstance(callbacks, DictConfig):
        return None
    raw = OmegaConf.to_container(callbacks, resolve=False)
    for node in raw.values():
        monitor = node.get("monitor") if isinstance(node, dict) else None
        if isinstance(monitor, str) and "${" not in monitor:
            mode = node.get("mode")
            return monitor, mode if mode in ("min", "max") else (mode_of(monitor) or "min")
    return None
