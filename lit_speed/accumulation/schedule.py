"""Accumulation schedules as plain functions: validation, lookup, ramps and LR rescaling.

A schedule maps a position (optimizer step, epoch, samples or tokens seen) to either an accumulation
factor (micro-batches per optimizer step) or a target effective batch (samples per optimizer step,
summed over processes). Nothing here touches Lightning, so every rule is testable on numbers.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

UNITS = ("step", "epoch", "samples", "tokens")
RAMPS = ("step", "linear")
LR_SCALINGS = ("none", "linear", "sqrt")


def validate_schedule(schedule: Mapping[int, int] | Sequence[Sequence[int]], name: str) -> dict[int, int]:
    """Check a ``{position: value}`` schedule and return a copy with int keys and values.

    Keys must be integers >= 0, strictly increasing in the order given, starting at 0; values must be
    integers >= 1. A list of ``[position, value]`` pairs is accepted too: Hydra *replaces* a list on the
    command line (``accumulation.factors=[[0,1],[200,4]]``) but *merges* a dict into the YAML's default.

    Args:
        schedule: The schedule as the user wrote it (a dict, a list of pairs, or their Hydra containers).
        name: The setting's name, used in error messages (e.g. ``"accumulation.factors"``).

    Raises:
        ValueError: If the schedule is empty, a key or value is not an integer, keys are not strictly
            increasing, the first key is not 0, or a value is < 1.

    Example::

        >>> validate_schedule({0: 1, 200: 4}, "factors")
        {0: 1, 200: 4}
        >>> validate_schedule([[0, 1], [200, 4]], "factors")
        {0: 1, 200: 4}
    """
    if not schedule:
        raise ValueError(f"{name} must not be empty; give at least {{0: <value>}}, e.g. {name}={{0: 4}}")
    if isinstance(schedule, Mapping):
        pairs = list(schedule.items())
    else:
        pairs = [tuple(pair) for pair in schedule]
        if any(len(pair) != 2 for pair in pairs):
            raise ValueError(f"{name} as a list must hold [position, value] pairs, got {list(schedule)}")
    items = []
    for key, value in pairs:
        try:
            ikey, ivalue = int(key), int(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name} keys and values must be integers, got {key!r}: {value!r}") from None
        if ikey != key or ivalue != value:
            raise ValueError(f"{name} keys and values must be integers, got {key!r}: {value!r}")
        items.append((ikey, ivalue))
    keys = [k for k, _ in items]
    if any(b <= a for a, b in zip(keys, keys[1:])):
        raise ValueError(f"{name} keys must be strictly increasing, got {keys}; sort them and drop duplicates")
    if keys[0] != 0:
        raise ValueError(f"{name} must start at position 0 (what applies before {keys[0]}?), got keys {keys}; "
                         f"add an entry 0: <value>")
    bad = [v for _, v in items if v < 1]
    if bad:
        what = "factor" if "factor" in name else "value"
        raise ValueError(f"{name}: every {what} must be >= 1, got {[v for _, v in items]}")
    return dict(items)


def value_at(schedule: Mapping[int, int], position: float, ramp: str = "step") -> float:
    """The schedule's value at ``position``: the last key <= position (``step``) or interpolated (``linear``).

    With ``linear``, the value moves linearly from one key's value to the next key's; after the last key it
    stays at the last value.

    Example::

        >>> value_at({0: 8, 100: 32}, 50, "linear")
        20.0
    """
    keys = list(schedule)
    idx = max(i for i, k in enumerate(keys) if k <= position) if position >= keys[0] else 0
    if ramp == "step" or idx == len(keys) - 1:
        return float(schedule[keys[idx]])
    lo, hi = keys[idx], keys[idx + 1]
    frac = (position - lo) / (hi - lo)
    return schedule[lo] + frac * (schedule[hi] - schedule[lo])


def factor_at(schedule: Mapping[int, int], position: float, ramp: str = "step") -> int:
    """Accumulation factor at ``position``; a linear ramp rounds down, never below 1."""
    return max(1, int(math.floor(value_at(schedule, position, ramp))))


def factor_for_effective_batch(target: float, micro_batch: int, world_size: int) -> int:
    """Micro-batches per step so that ``micro_batch * factor * world_size`` is the largest multiple <= target.

    Never below one micro-batch per process. Used for linear ramps whose in-between values are not
    multiples of ``micro_batch * world_size``.
    """
    return max(1, int(target // (micro_batch * world_size)))


def check_divisible(effective_batch: Mapping[int, int], micro_batch: int, world_size: int, name: str) -> None:
    """Every scheduled effective batch must be a multiple of ``micro_batch * world_size``.

    Raises:
        ValueError: Naming the first value that is not, and the nearest values that are.
    """
    unit = micro_batch * world_size
    for key, value in effective_batch.items():
        if value % unit:
            lower, upper = max(unit, value // unit * unit), (value // unit + 1) * unit
            raise ValueError(
                f"{name}[{key}] = {value} is not divisible by micro_batch ({micro_batch}) x world size "
                f"({world_size}) = {unit}; use {lower} or {upper}, or change the micro-batch")


def lr_scale(effective_batch: float, base_effective_batch: float, rule: str) -> float:
    """LR multiplier for an effective batch relative to the base one: 1, the ratio, or its square root.

    Example::

        >>> lr_scale(128, 32, "sqrt")
        2.0
    """
    if rule == "none":
        return 1.0
    ratio = effective_batch / base_effective_batch
    return ratio if rule == "linear" else math.sqrt(ratio)


def check_choice(value: str, allowed: tuple[str, ...], name: str) -> str:
    """Return ``value`` if it is one of ``allowed``, else raise a ValueError naming the setting."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def checked_argument(arg: str, value: Any, check: Callable[..., Any], *args: Any) -> Any:
    """``check(value, *args, arg)``; its ValueError says which AccumulationScheduler argument it is about."""
    try:
        return check(value, *args, arg)
    except ValueError as error:
        raise ValueError(f"AccumulationScheduler({arg}={value!r}): {error}") from error
