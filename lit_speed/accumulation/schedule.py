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
            lower, upper = value // unit * unit, (value // unit + 1) * unit
            nearest = f"{lower} or {upper}" if lower else f"{upper}"  # below one micro-batch: only the one above
            raise ValueError(
                f"{name}[{key}] = {value} is not divisible by micro_batch ({micro_batch}) x world size "
                f"({world_size}) = {unit}; use {nearest}, or change the micro-batch")


def schedule_plan(schedule: Mapping[int, int], in_factors: bool, unit: str, ramp: str, micro_batch: int | None,
                  world_size: int, name: str = "effective_batch") -> tuple[int, int, str]:
    """Micro-batches per optimizer step at the start of a schedule, and where it goes from there, in words.

    Args:
        schedule: ``{position: factor}`` (``in_factors``) or ``{position: effective batch over all processes}``.
        in_factors: Whether the values are factors (else effective batches).
        unit: What the positions count (``step``, ``epoch``, ``samples``, ``tokens``).
        ramp: ``step`` or ``linear``.
        micro_batch: Samples per micro-batch; ``None`` when chosen later (``micro_batch="auto"``).
        world_size: Processes.
        name: The argument's name, for the error.

    Returns:
        ``(factor at the start, largest factor, "then ..." or "")``, e.g. ``(1, 4, "rising linearly (whole
        micro-batches) to 256 (x4) at step 50")``.

    Raises:
        ValueError: An effective batch ``micro_batch x world_size`` does not divide, at any key of either ramp (the
            keys are what the schedule promises; a linear ramp rounds only between them).
    """
    at = (lambda key: f"at {unit} {key:,}") if unit in ("step", "epoch") else (lambda key: f"after {key:,} {unit}")
    how = "rising linearly (whole micro-batches) to" if ramp == "linear" else "then"
    keys = list(schedule)
    if in_factors:
        later = [f"x{schedule[k]}" + (f" = {micro_batch * schedule[k] * world_size:,}" if micro_batch else "")
                 + f" {at(k)}" for k in keys[1:]]
        return schedule[keys[0]], max(schedule.values()), (f"{how} {', '.join(later)}" if later else "")
    if micro_batch is None:
        return 1, 1, f"effective batch {dict(schedule)} ({ramp} ramp): the micro-batch is chosen at setup"
    check_divisible(schedule, micro_batch, world_size, name)
    factor = {k: factor_for_effective_batch(v, micro_batch, world_size) for k, v in schedule.items()}
    later = [f"{schedule[k]:,} (x{factor[k]}) {at(k)}" for k in keys[1:]]
    return factor[keys[0]], max(factor.values()), (f"{how} {', '.join(later)}" if later else "")


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
