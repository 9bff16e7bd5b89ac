"""Choose between implementations of the same math by timing them here, interleaved, and cache the choice.

:func:`time_interleaved` runs one call of every candidate per round (the order rotating, after one warm-up call
each), so a busy machine slows every candidate alike; :func:`choose_fastest` keeps the default unless another
candidate is faster by ``min_gain``; :func:`measured_choice` does both once per machine and key, caching the
timings (:func:`~lit_speed.tuning.machine_cache.measured_times`, the cache of every measured choice) so that a
repeated run decides in no time and the same way.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from lit_speed.tuning.machine_cache import OtherLoad, cache_dir, cached_times, measured_times, store_times

#: The default is kept unless another candidate takes at most ``1 - MIN_GAIN`` of its time: one margin for every
#: measured choice (precision=auto, threads, Muon's dtype, AdamW's kernel). It is also the most a wrong keep of
#: the default can cost: at 0.05, 5 of 20 cold precision=auto decisions on charlm_fast kept 32-true while
#: bf16-master was 6.6% faster; at 0.02 the worst of 25 decisions cost 1.9% (benchmarks/bench_auto_decision.py,
#: LOG.md 2026-11-23).
MIN_GAIN = 0.02
#: :func:`time_interleaved` stops before its ``rounds`` once this many rounds have separated the candidates (see
#: :func:`separated`): more rounds could not change the choice, and at a step of 50-100 ms each round is a tenth of
#: a second of the user's run.
SEPARATED_AFTER = 3
#: Calls shorter than this are not stopped early: their rounds cost nothing worth saving.
SEPARATED_MIN_CALL_S = 1e-3


@dataclass
class Decision:
    """A measured choice: what was chosen, why, and the median seconds per candidate (``None``: could not run)."""

    name: str
    chosen: str
    reason: str
    times: dict[str, float | None] = field(default_factory=dict)
    cached_on: str | None = None  # the date of the cached timings it reused, or None when timed in this run

    def line(self) -> str:
        """One line for the log and the start-up table: ``name -> chosen (reason)``."""
        return f"{self.name} -> {self.chosen} ({self.reason})"


def time_interleaved(candidates: Mapping[str, Callable[[], Any]], rounds: int = 10, budget_s: float = 1.0
                     ) -> dict[str, list[float] | None]:
    """Seconds of each call of each candidate, in round order; ``None`` for one that raised.

    One warm-up call each, then rounds of one call per candidate (order rotating) until ``rounds`` are done or
    ``budget_s`` is spent, but at least two rounds; or sooner, after :data:`SEPARATED_AFTER` rounds, when the
    candidates are :func:`separated` (calls of at least :data:`SEPARATED_MIN_CALL_S`).
    """
    live: list[str] = []
    for name, fn in candidates.items():
        try:
            fn()
            live.append(name)
        except (RuntimeError, TypeError, ValueError, NotImplementedError):  # this kernel cannot run here
            pass
    samples: dict[str, list[float]] = {name: [] for name in live}
    deadline = time.perf_counter() + budget_s
    for r in range(max(rounds, 2)):
        if r >= 2 and time.perf_counter() > deadline:
            break
        if r >= SEPARATED_AFTER and live and separated(samples) \
                and min(map(min, samples.values())) >= SEPARATED_MIN_CALL_S:
            break
        for name in (live[r % len(live):] + live[:r % len(live)]) if live else []:
            start = time.perf_counter()
            candidates[name]()
            samples[name].append(time.perf_counter() - start)
    return {name: samples.get(name) for name in candidates}


def separated(samples: Mapping[str, list[float]], min_gain: float = MIN_GAIN) -> bool:
    """Whether one candidate's slowest call beat every other candidate's fastest by ``min_gain``: no round would
    rank them otherwise, so further rounds cannot change :func:`choose_fastest`'s choice."""
    if len(samples) < 2:
        return True
    best = min(samples, key=lambda n: statistics.median(samples[n]))
    return all(max(samples[best]) <= (1.0 - min_gain) * min(v) for n, v in samples.items() if n != best)


def choose_fastest(times: Mapping[str, float | None], default: str, min_gain: float = MIN_GAIN,
                   unit: str = "ms") -> tuple[str, str]:
    """The fastest candidate, or ``default`` unless one beats it by ``min_gain``; and the reason, every time shown.

    Raises:
        ValueError: If ``default`` is not a candidate.
    """
    if default not in times:
        raise ValueError(f"default must be one of the candidates {sorted(times)}, got {default!r}")
    finite = {n: t for n, t in times.items() if t is not None and math.isfinite(t)}
    scale = 1000.0 if unit == "ms" else 1.0
    shown = ", ".join(f"{n} {scale * t:.2f} {unit}" if t is not None else f"{n} could not run" for n, t in times.items())
    if not finite:
        return default, f"no candidate could run ({shown}): kept the default"
    best = min(finite, key=finite.__getitem__)
    base = finite.get(default)
    if base is not None and best != default and finite[best] > (1.0 - min_gain) * base:
        return default, f"timed here: {shown}; within {min_gain:.0%} of the default: kept it"
    return best, f"timed here: {shown}"


def measured_choice(name: str, key: Mapping[str, Any], candidates: Mapping[str, Callable[[], Any]], default: str,
                    min_gain: float = MIN_GAIN, rounds: int = 10, budget_s: float = 1.0,
                    use_disk_cache: bool | None = None, scale: Mapping[str, float] | None = None,
                    unit: str = "ms") -> Decision:
    """Time ``candidates`` (or reuse this machine's cached timings for ``key``) and choose one.

    Args:
        name: The setting decided (e.g. ``"optimizer.ns_dtype"``); also names the cache file.
        key: What the timings depend on besides the machine (shapes, dtypes, ...), JSON-serialisable.
        candidates: Name -> a call that runs that implementation once.
        default: The candidate kept unless another is faster by ``min_gain``.
        min_gain: See :func:`choose_fastest`.
        rounds, budget_s: See :func:`time_interleaved`.
        use_disk_cache: Read and write the on-disk cache (default: unless ``LIT_SPEED_AUTO_CACHE=0``).
        scale: Candidate -> how many of its calls the run's work is, when the candidates' calls are samples of
            different sizes (a packed row against a padded one): the choice compares ``median x scale``. The cache
            keeps the medians, so ``scale`` may change between runs without re-timing.
        unit: ``ms`` or ``s``, for the reason's times.
    """
    path = _path(name)
    medians, cached_on = measured_times(path, _full_key(name, candidates, key),
                                        lambda: time_interleaved(candidates, rounds, budget_s), name,
                                        use_disk_cache=use_disk_cache)
    return _decision(name, path, medians, cached_on, default, min_gain, unit, scale)


def cached_choice(name: str, key: Mapping[str, Any], candidates: Sequence[str], default: str,
                  min_gain: float = MIN_GAIN, unit: str = "ms") -> Decision | None:
    """:func:`measured_choice` from this machine's cache alone (the same file and key), ``None`` when not cached:
    for a choice timed on the run's own steps (:func:`recorded_choice` stores what those steps measured)."""
    path = _path(name)
    found = cached_times(path, _full_key(name, candidates, key))
    return None if found is None else _decision(name, path, found[0], found[1], default, min_gain, unit)


def recorded_choice(name: str, key: Mapping[str, Any], samples: Mapping[str, list[float] | None], default: str,
                    load: OtherLoad, how: str, min_gain: float = MIN_GAIN, unit: str = "ms") -> Decision:
    """:func:`measured_choice` of samples timed elsewhere (``how`` replaces "timed here" in the reason), cached as
    :func:`measured_choice` caches its own timings unless ``load`` saw a busy machine."""
    path = _path(name)
    medians = store_times(path, _full_key(name, samples, key), samples, name, load)
    decision = _decision(name, path, medians, None, default, min_gain, unit)
    decision.reason = decision.reason.replace("timed here", how, 1)
    return decision


def _path(name: str) -> Path:
    return cache_dir() / f"{name.replace('/', '_')}.json"


def _full_key(name: str, candidates: Iterable[str], key: Mapping[str, Any]) -> dict[str, Any]:
    return {"name": name, "candidates": sorted(candidates), **dict(key)}


def _decision(name: str, path: Path, medians: Mapping[str, float | None], cached_on: str | None, default: str,
              min_gain: float, unit: str, scale: Mapping[str, float] | None = None) -> Decision:
    times = dict(medians) if scale is None else {n: None if t is None else t * scale[n] for n, t in medians.items()}
    chosen, reason = choose_fastest(times, default, min_gain, unit)
    if cached_on:
        reason = f"{reason} (cached {cached_on} in {path})"
    return Decision(name, chosen, reason, times, cached_on)


def on_rank_zero(decide: Callable[[], Any], trainer: Any = None) -> Any:
    """``decide()`` on rank 0 only, its answer sent to every process when several run: the ranks must step alike, and
    one timing is enough. The one "decide on rank 0, then broadcast" of lit_speed.

    Args:
        decide: Makes the decision (a :class:`Decision`, or any picklable value).
        trainer: A Lightning ``Trainer``: its ranks and its strategy's ``broadcast`` (any strategy, DeepSpeed's
            included); ``None``: ``torch.distributed``'s default group, when it is initialised.
    """
    if trainer is not None:
        if trainer.world_size < 2:
            return decide()
        return trainer.strategy.broadcast(decide() if trainer.global_rank == 0 else None, src=0)
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return decide()
    box = [decide() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
