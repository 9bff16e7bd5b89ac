"""The non-finite guard as plain functions: detect, classify, decide (skip, fall back, or raise).

A bad step is one whose loss or (unscaled) gradients hold inf/NaN. It is *genuine* unless a loss scaler can
still fix it: a finite loss with overflowing fp16 gradients while the scale is above ``min_scale`` is the
dynamic loss scaler doing its job (skip and back off), not a reason to fall back or stop.
"""
from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import torch
from torch import Tensor

from lit_speed.tensors import all_finite, finite

__all__ = ["Action", "GuardCounters", "all_finite", "decide", "first_nonfinite", "is_genuine"]


class Action(enum.Enum):
    STEP = "step"
    SKIP = "skip"
    FALLBACK = "fallback"
    RAISE = "raise"


@dataclass
class GuardCounters:
    """Counts that survive a resume (saved in the plugin's ``state_dict``)."""

    attempted_steps: int = 0
    skipped_steps: int = 0
    consecutive_bad: int = 0
    fallbacks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def nonfinite_rate(self) -> float:
        """Share of optimizer steps skipped since the start of the run."""
        return self.skipped_steps / self.attempted_steps if self.attempted_steps else 0.0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.attempted_steps = int(state.get("attempted_steps", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.consecutive_bad = int(state.get("consecutive_bad", 0))
        self.fallbacks = [dict(f) for f in state.get("fallbacks", [])]


def first_nonfinite(named: Iterable[tuple[str, Tensor]]) -> str | None:
    """Name of the first tensor holding inf/NaN and what it holds (for messages; syncs per tensor)."""
    for name, t in named:
        if not bool(finite(t)):
            kind = "nan" if bool(torch.isnan(t).any()) else "inf"
            return f"{name} ({kind})"
    return None


def is_genuine(loss_finite: bool, grads_finite: bool, scale: float | None, min_scale: float) -> bool:
    """A bad step the loss scaler cannot fix by backing off (see the module docstring)."""
    if not loss_finite:
        return True
    if grads_finite:
        return False
    return scale is None or scale <= min_scale


def decide(counters: GuardCounters, bad: bool, genuine: bool, policy: str, fallback_after: int,
           has_next_mode: bool) -> Action:
    """Update ``counters`` for one optimizer step and return what the plugin must do.

    Args:
        counters: Updated in place.
        bad: The loss or the unscaled gradients hold inf/NaN.
        genuine: See :func:`is_genuine`; only genuine bad steps count towards fallback or raise.
        policy: ``skip`` | ``fallback`` | ``raise``.
        fallback_after: Consecutive genuine bad steps that trigger a fallback.
        has_next_mode: The fallback chain is not exhausted.
    """
    counters.attempted_steps += 1
    if not bad:
        counters.consecutive_bad = 0
        return Action.STEP
    counters.skipped_steps += 1
    if not genuine:
        return Action.SKIP
    counters.consecutive_bad += 1
    if policy == "raise":
        return Action.RAISE
    if policy == "fallback" and counters.consecutive_bad >= fallback_after:
        return Action.FALLBACK if has_next_mode else Action.RAISE
    return Action.SKIP
