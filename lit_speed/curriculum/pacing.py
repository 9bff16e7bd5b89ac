"""Pacing functions: how much of the easiest-first training set is allowed at each point of training.

Plain functions of numbers, usable without Lightning. ``progress`` is the fraction of the pacing
phase that has elapsed (0 at the first batch, 1 when the full set must be in use). The shapes follow
Hacohen & Weinshall (2019) and Platanios et al. (2019, "competence"); every one starts at
``start_fraction`` and returns exactly 1.0 once ``progress >= 1``.
"""
from __future__ import annotations

import math

PACING_KINDS = ("linear", "root", "step", "exponential", "none")


def check_pacing(kind: str, start_fraction: float, stages: int = 4) -> None:
    """Raise a ``ValueError`` that names the bad setting, what is allowed and how to fix it."""
    if kind not in PACING_KINDS:
        raise ValueError(f"pacing must be one of {PACING_KINDS}, got {kind!r}; pick one, e.g. pacing=linear")
    if not 0.0 < start_fraction <= 1.0:
        raise ValueError(f"start_fraction must be in (0, 1], got {start_fraction}; "
                         "it is the share of the easiest samples used at the first step, e.g. 0.25")
    if stages < 1:
        raise ValueError(f"pace_stages must be >= 1 (the number of jumps of the step pacing), got {stages}")


def pacing_fraction(kind: str, progress: float, start_fraction: float, stages: int = 4) -> float:
    """Share of the training set (easiest first) allowed at ``progress`` through the pacing phase.

    Args:
        kind: ``linear`` (a + (1-a)p), ``root`` (sqrt(a^2 + (1-a^2)p)), ``step`` (``stages`` equal jumps),
            ``exponential`` (a^(1-p), doubling-style growth) or ``none`` (always the full set).
        progress: Elapsed share of the pacing phase; clipped to [0, 1].
        start_fraction: ``a``, the share allowed at progress 0, in (0, 1].
        stages: Number of jumps of the ``step`` pacing.

    Raises:
        ValueError: If ``kind``, ``start_fraction`` or ``stages`` is out of range.

    Example::

        >>> pacing_fraction("linear", 0.5, 0.2)
        0.6
    """
    check_pacing(kind, start_fraction, stages)
    p = min(max(float(progress), 0.0), 1.0)
    a = float(start_fraction)
    if kind == "none" or p >= 1.0:
        return 1.0
    if kind == "linear":
        return a + (1.0 - a) * p
    if kind == "root":
        return math.sqrt(a * a + (1.0 - a * a) * p)
    if kind == "step":
        return a + (1.0 - a) * math.floor(p * stages) / stages
    return a ** (1.0 - p)  # exponential


def allowed_count(total: int, fraction: float, minimum: int = 1) -> int:
    """Number of easiest samples allowed: ``ceil(fraction * total)``, at least ``minimum``, at most ``total``.

    ``minimum`` is the world size under DDP, so that no rank is left with an empty shard.
    """
    if total < 1:
        raise ValueError(f"the training set is empty (total={total}); a curriculum needs at least one sample")
    # round before ceil so 0.3 * 10 (= 3.0000000000000004) allows 3, not 4
    return int(min(total, max(minimum, math.ceil(round(fraction * total, 9)))))


def progress_at(batch: int, duration: int) -> float:
    """Progress through a pacing phase of ``duration`` batches at global batch ``batch`` (0-based)."""
    return 1.0 if duration <= 0 else batch / duration


def seq_len_at(batch: int, start_len: int, full_len: int, duration: int, multiple: int = 8) -> int:
    """Sequence-length warm-up: a linear ramp from ``start_len`` to ``full_len`` over ``duration`` batches.

    The length is rounded down to a multiple of ``multiple`` (kernel-friendly shapes, fewer distinct
    shapes for compiled models) but never below ``start_len``; from ``batch >= duration`` it is ``full_len``.

    Raises:
        ValueError: If ``start_len`` is not in [1, full_len] or ``multiple`` < 1.
    """
    if not 1 <= start_len <= full_len:
        raise ValueError(f"seq_len_start must be in [1, block_size={full_len}], got {start_len}")
    if multiple < 1:
        raise ValueError(f"seq_len_multiple must be >= 1, got {multiple}")
    if duration <= 0 or batch >= duration:
        return full_len
    length = start_len + (full_len - start_len) * batch / duration
    return int(max(start_len, min(full_len, (int(length) // multiple) * multiple)))
