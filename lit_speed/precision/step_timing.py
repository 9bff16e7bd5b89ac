"""``precision=auto`` decided by timing the user's own training step in each candidate mode.

A matmul probe says how fast bf16 GEMMs are; it does not say how fast *this* model's step is (small
models are dominated by per-op overhead, autocast adds casts). :func:`time_modes` runs forward+backward+
optimizer steps of copies of the model on one real micro-batch in each mode, **interleaved** (one step of
each mode per round, the order rotating) so that a busy machine slows every mode alike, and returns the
median step seconds (``None`` for a mode whose loss is not finite); :func:`choose_by_timing` picks the
fastest, and keeps ``32-true`` unless a low-precision mode is clearly faster.

The timings are cached per model class, parameter count and dtype, batch shapes, device, CPU/GPU model,
thread count and torch version, in the cache of every measured choice (:func:`lit_speed.tuning.machine_cache.
measured_times`): in the process, and on disk (file ``precision_auto.json`` of the per-machine folder), so a
repeated run on the same machine decides in no time and decides the same way. One exception: a decision that kept
``32-true`` although a low-precision mode timed faster (inside the margin) is not :func:`settled`: the next runs
time it again, their rounds pooled with the cached ones, until :data:`SETTLE_ROUNDS` rounds per mode are in: a
noisy first second must not decide for good. ``LIT_SPEED_AUTO_CACHE=0`` times afresh (and does not write);
deleting the file does too.
"""
from __future__ import annotations

import copy
import math
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from lit_speed.compat import lightning as pl_compat
from lit_speed.precision import modes as mode_table
from lit_speed.precision.fp32_modules import cast_floating
from lit_speed.precision.master_weights import MasterWeights
from lit_speed.tuning.machine_cache import cache_dir, disk_cache_enabled, measured_times, read_json, timing_key
from lit_speed.tuning.measured_choice import MIN_GAIN, choose_fastest, time_interleaved

#: An undecided entry (32-true kept although a low-precision mode timed faster, inside the margin) is timed
#: again by the next runs, pooling their rounds, until it holds this many rounds per mode: a first decision made
#: in a noisy second is not cached for good.
SETTLE_ROUNDS = 36
#: Bumped when the timing procedure changes, so older cached timings are not reused (5: lit_speed.tuning's loop).
PROCEDURE = 5


def loss_of(module: nn.Module, batch: Any) -> torch.Tensor:
    """The loss of ``module`` on ``batch`` as a training step computes it (``training_step``, else the forward)."""
    step = getattr(module, "training_step", None)
    out = step(batch, 0) if step is not None else module(batch)
    return out["loss"] if isinstance(out, dict) else out


def time_modes(module: nn.Module, batch: Any, modes: Sequence[str], steps: int = 12, budget_s: float = 1.5,
               loss_fn: Callable[[nn.Module, Any], torch.Tensor] = loss_of,
               use_disk_cache: bool | None = None) -> dict[str, float | None]:
    """Median seconds of a forward+backward+AdamW step of a copy of ``module`` on ``batch`` in each mode.

    ``module`` itself is not touched (each mode trains a deep copy; torch's RNG is restored afterwards). The
    optimizer is a fused AdamW over float32 parameters in every mode, as in ``bf16-master`` and the mixed
    modes, so the comparison is of the forward and backward passes. After one warm-up step per mode, rounds
    of one timed step per mode run until ``steps`` rounds are done or ``budget_s`` is spent (at least two
    rounds). ``use_disk_cache`` (default: unless ``LIT_SPEED_AUTO_CACHE=0``) reads and writes the on-disk cache.
    """
    return _timings(module, batch, modes, steps, budget_s, loss_fn, use_disk_cache)[0]


def _timings(module: nn.Module, batch: Any, modes: Sequence[str], steps: int = 12, budget_s: float = 1.5,
             loss_fn: Callable[[nn.Module, Any], torch.Tensor] = loss_of, use_disk_cache: bool | None = None
             ) -> tuple[dict[str, float | None], str | None]:
    """:func:`time_modes`, and the date the timings were taken when they came from the on-disk cache.

    An entry that is not settled (:func:`settled`) is timed again and the new rounds pooled with the cached ones.
    """
    def sample() -> dict[str, list[float] | None]:
        with torch.random.fork_rng(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # self.log() outside a loop warns
            return _sample_interleaved(detached_copy(module), batch, modes, steps, budget_s, loss_fn)

    key, device = cache_key(module, batch, modes)
    return measured_times(cache_file(), key, sample, "precision=auto", device=device, use_disk_cache=use_disk_cache,
                          settled=settled, in_process=True)


def settled(entry: dict[str, Any]) -> bool:
    """Whether a cached entry decides for good: clear, or pooled over :data:`SETTLE_ROUNDS` rounds per mode."""
    samples = entry.get("samples") or {}
    rounds = min((len(v) for v in samples.values() if v), default=0)
    times = {m: t for m, t in entry.get("times", {}).items() if t is not None}
    base = times.get(mode_table.BASELINE)
    undecided = base is not None and choose_by_timing(times)[0] == mode_table.BASELINE and min(times.values()) < base
    return not undecided or rounds >= SETTLE_ROUNDS


def cached_when(module: nn.Module, batch: Any, modes: Sequence[str]) -> str | None:
    """The date the on-disk cache holds timings for this model/batch/machine from, or ``None``."""
    key, device = cache_key(module, batch, modes)
    entry = read_json(cache_file()).get(timing_key(key, device)) if disk_cache_enabled() else None
    return None if entry is None else str(entry.get("when"))


def detached_copy(module: nn.Module) -> nn.Module:
    """A deep copy in train mode, without the attached Trainer (Lightning keeps it on the module)."""
    with pl_compat.detached_from_trainer(module):  # deepcopy the model, not the Trainer
        return copy.deepcopy(module).train()


class ModeRun:
    """One candidate mode: its own copy of the model, optimizer and (``bf16-master``) float32 masters."""

    def __init__(self, base: nn.Module, mode: str, loss_fn: Callable[[nn.Module, Any], torch.Tensor]) -> None:
        mode, _, self.kernel = mode.partition("+")  # "<mode>+math": the math attention kernel (AttentionChoice.with_modes)
        spec = mode_table.spec(mode)
        self.model = copy.deepcopy(base)
        self.device_type = next(self.model.parameters()).device.type
        self.masters = MasterWeights(self.model) if spec.master_weights else None
        if spec.module_dtype is not None and self.masters is None:
            self.model.to(spec.module_dtype)
        params = list(self.masters.parameters()) if self.masters is not None else list(self.model.parameters())
        self.opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
        autocast = spec.autocast_dtype
        self.context = lambda: mode_table.autocast_context(self.device_type, autocast)
        self.loss_fn = loss_fn
        # a bf16 module trains on bf16 inputs (GuardedPrecision.convert_input casts them there too)
        module_dtype = spec.module_dtype
        self.convert: Callable[[Any], Any] = (lambda b: cast_floating(b, module_dtype)) \
            if module_dtype is not None else (lambda b: b)
        self.finite = True

    def step(self, batch: Any) -> None:
        with self.context(), sdpa_kernel([SDPBackend.MATH]) if self.kernel == "math" else nullcontext():
            loss = self.loss_fn(self.model, self.convert(batch))
        if not torch.isfinite(loss.detach()).all():
            self.finite = False
        loss.float().backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.masters is not None:
            self.masters.copy_to_model()
        if self.device_type == "cuda":
            torch.cuda.synchronize()  # the step's kernels are in its time


def _sample_interleaved(base: nn.Module, batch: Any, modes: Sequence[str], steps: int, budget_s: float,
                        loss_fn: Callable[[nn.Module, Any], torch.Tensor]) -> dict[str, list[float] | None]:
    """Every timed step's seconds per mode, in round order, by :func:`lit_speed.tuning.time_interleaved` (one
    warm-up step each, then rotating rounds); ``None`` for a mode that could not run or whose loss was not finite."""
    runs: dict[str, ModeRun] = {}

    def candidate(mode: str) -> Callable[[], None]:
        def step() -> None:
            if mode not in runs:  # the warm-up call builds the mode's copy: allocations, kernel selection
                runs[mode] = ModeRun(base, mode, loss_fn)  # a RuntimeError here: the mode cannot run this step
                runs[mode].step(batch)
                if not runs[mode].finite:
                    raise ValueError(f"{mode}: the loss is not finite")  # left out of the rounds
                return
            runs[mode].step(batch)
        return step

    samples = time_interleaved({mode: candidate(mode) for mode in modes}, rounds=steps, budget_s=budget_s)
    return {m: (samples[m] if samples[m] is not None and runs[m].finite else None) for m in modes}


def choose_by_timing(times: dict[str, float | None], min_gain: float = MIN_GAIN) -> tuple[str, str]:
    """The fastest finite mode by :func:`lit_speed.tuning.choose_fastest` (``32-true`` kept unless another mode
    beats it by ``min_gain``), and the reason with every measured step time (for the start-up table)."""
    finite = {m: t for m, t in times.items() if t is not None and math.isfinite(t)}
    shown = ", ".join(f"{m} {1000 * t:.1f} ms" if t is not None else f"{m} non-finite" for m, t in times.items())
    if not finite:
        return mode_table.BASELINE, f"no mode gave a finite loss when timed ({shown})"
    best, _ = choose_fastest({mode_table.BASELINE: None, **finite}, mode_table.BASELINE, min_gain)
    return best, f"timed this model's step on one micro-batch: {shown}"


def auto_mode_for(module: nn.Module, batch: Any, candidates: Sequence[str], device: torch.device | None = None
                  ) -> tuple[str | None, str]:
    """Time ``candidates`` on ``batch`` (a training batch as the loader yields it, before its transfer) and pick one.

    Leaves no trace in the run: the timing trains copies of ``module`` (the module's own transfer hooks run on a
    copy too, the datamodule's are not called), and the torch, numpy and python RNG states are what they were.

    Returns:
        ``(mode, reason)``; ``(None, why)`` when this model's step could not run on the batch (the caller decides
        by rule then).
    """
    try:
        with preserved_rng_states(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            batch = as_step_input(module, batch, device)
            times, when = _timings(module, batch, candidates)
    except Exception as error:  # noqa: BLE001 - a step this timer cannot run (a hook needing the Trainer, ...)
        first = str(error).strip().splitlines()[0][:160] if str(error).strip() else ""
        return None, f"could not time this model's step on its first batch ({type(error).__name__}: {first})"
    if all(t is None for t in times.values()):
        return None, "no candidate mode gave a finite loss on the first batch"
    mode, reason = choose_by_timing(times)
    if when is not None:
        reason = reason.replace("on one micro-batch", f"on one micro-batch (cached {when} in {cache_file()})", 1)
    return mode, reason


def as_step_input(module: nn.Module, batch: Any, device: torch.device | None) -> Any:
    """``batch`` as ``training_step`` sees it: the module's own transfer hooks, run on a copy of the module."""
    from lightning.fabric.utilities.apply_func import move_data_to_device

    target = device or next((p.device for p in module.parameters()), torch.device("cpu"))
    hooks = getattr(module, "on_before_batch_transfer", None)
    if hooks is None:  # a plain nn.Module: only the move
        return move_data_to_device(batch, target)
    copy_ = detached_copy(module)
    batch = copy_.on_before_batch_transfer(batch, 0)
    batch = copy_.transfer_batch_to_device(batch, target, 0)
    return copy_.on_after_batch_transfer(batch, 0)


class preserved_rng_states:
    """Context manager: the torch (CPU and CUDA), numpy and python RNG states on exit are those on entry."""

    def __enter__(self) -> "preserved_rng_states":
        import random

        import numpy as np

        self._torch = torch.random.fork_rng()
        self._torch.__enter__()
        self._numpy, self._python = np.random.get_state(), random.getstate()
        return self

    def __exit__(self, *exc: Any) -> None:
        import random

        import numpy as np

        np.random.set_state(self._numpy)
        random.setstate(self._python)
        self._torch.__exit__(*exc)


# ---- the cache key and the on-disk cache ------------------------------------------------------------------


def cache_key(module: nn.Module, batch: Any, modes: Sequence[str]) -> tuple[dict[str, Any], torch.device]:
    """What the timings depend on besides the machine (the model, the batch, the modes), and the device they run on
    (:func:`~lit_speed.tuning.machine_cache.timing_key` adds the machine and software of that device)."""
    params = list(module.parameters())
    device = params[0].device if params else torch.device("cpu")
    return {"procedure": PROCEDURE, "model": f"{type(module).__module__}.{type(module).__qualname__}",
            "params": sum(p.numel() for p in params), "dtypes": sorted({str(p.dtype) for p in params}),
            "batch": batch_shapes(batch), "modes": list(modes), "device": str(device)}, device


def cache_file() -> Path:
    """Where ``precision=auto`` keeps its timings on disk (the per-machine cache folder of :mod:`lit_speed.tuning`)."""
    return cache_dir() / "precision_auto.json"


def batch_shapes(batch: Any) -> Any:
    """The shapes and dtypes of a batch's tensors, nested as the batch is (part of a timing's cache key)."""
    if isinstance(batch, torch.Tensor):
        return [list(batch.shape), str(batch.dtype)]
    if isinstance(batch, (list, tuple)):
        return [batch_shapes(b) for b in batch]
    if isinstance(batch, dict):
        return [[str(k), batch_shapes(v)] for k, v in sorted(batch.items(), key=lambda kv: str(kv[0]))]
    return type(batch).__name__


# ---- the intra-op thread count, timed on the same step -------------------------------------------------------


def thread_candidates(cores: int, processes: int = 1) -> list[int]:
    """Thread counts worth timing for one of ``processes`` on ``cores`` cores: powers of two up to its share,
    and the share itself."""
    share = max(1, cores // max(1, processes))
    counts = {share}
    n = 1
    while n < share:
        counts.add(n)
        n *= 2
    return sorted(counts)


def step_key(module: nn.Module, mode: str, step_input: Any) -> dict[str, Any]:
    """What a timing of this model's step depends on besides the machine (the cache key's part of the measured
    choices timed on the step: threads, the attention kernel): model class, mode, parameter count, batch shapes."""
    return {"model": f"{type(module).__module__}.{type(module).__qualname__}", "mode": mode,
            "params": sum(p.numel() for p in module.parameters()), "batch": batch_shapes(step_input)}


def choose_threads(module: nn.Module, batch: Any, mode: str, counts: Sequence[int],
                   device: torch.device | None = None) -> Any:
    """Time this model's step (in ``mode``) at each intra-op thread count, interleaved, and pick one: the count
    in use now is kept unless another is faster by the tuning margin. Cached per machine like the precision
    timings; leaves no trace in the run (copies of the model; RNG states restored; the thread count restored).

    Returns:
        A :class:`~lit_speed.tuning.Decision` whose ``chosen`` is the count as a string.
    """
    from lit_speed.tuning import measured_choice

    current = torch.get_num_threads()
    counts = sorted(set(counts) | {current})
    with preserved_rng_states(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step_input = as_step_input(module, batch, device)
        base = detached_copy(module)
        runs = {n: ModeRun(base, mode, loss_of) for n in counts}

        def at(n: int) -> Callable[[], None]:
            def run() -> None:
                torch.set_num_threads(n)
                runs[n].step(step_input)
            return run

        try:
            return measured_choice("precision.threads", step_key(module, mode, step_input),
                                   {str(n): at(n) for n in counts}, default=str(current))
        finally:
            torch.set_num_threads(current)
