"""``precision=auto`` decided by timing the user's own training step in each candidate mode.

A matmul probe says how fast bf16 GEMMs are; it does not say how fast *this* model's step is (small
models are dominated by per-op overhead, autocast adds casts). :func:`time_modes` runs a few
forward+backward+optimizer steps of a copy of the model on one real micro-batch in each mode and
returns the median step seconds (``None`` for a mode whose loss is not finite); :func:`choose_by_timing`
picks the fastest, and keeps ``32-true`` unless a low-precision mode is clearly faster. Results are
cached per model class, parameter count, batch shape, device and thread count.
"""
from __future__ import annotations

import copy
import math
import time
import warnings
from contextlib import nullcontext
from typing import Any, Callable, Sequence

import torch
from torch import nn

from lit_speed.compat import lightning as pl_compat
from lit_speed.precision.master_weights import MasterWeights

#: A low-precision mode must beat 32-true by this fraction to be chosen (timing noise on a shared machine).
MIN_GAIN = 0.05
_CACHE: dict[tuple, dict[str, float | None]] = {}


def _loss_of(module: nn.Module, batch: Any) -> torch.Tensor:
    step = getattr(module, "training_step", None)
    out = step(batch, 0) if step is not None else module(batch)
    return out["loss"] if isinstance(out, dict) else out


def time_modes(module: nn.Module, batch: Any, modes: Sequence[str], steps: int = 3, budget_s: float = 3.0,
               loss_fn: Callable[[nn.Module, Any], torch.Tensor] = _loss_of) -> dict[str, float | None]:
    """Median seconds of a forward+backward+AdamW step of a copy of ``module`` on ``batch`` in each mode.

    ``module`` itself is not touched (each mode trains a deep copy; torch's RNG is restored afterwards). The
    optimizer is a fused AdamW over float32 parameters in every mode, as in ``bf16-master`` and the mixed
    modes, so the comparison is of the forward and backward passes. Stops timing when ``budget_s`` is spent.
    """
    key = (type(module).__name__, sum(p.numel() for p in module.parameters()), _shapes(batch),
           str(next(module.parameters()).device), torch.get_num_threads(), tuple(modes))
    if key in _CACHE:
        return dict(_CACHE[key])
    results: dict[str, float | None] = {}
    deadline = time.perf_counter() + budget_s
    with torch.random.fork_rng(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log() outside a loop warns
        with pl_compat.detached_from_trainer(module):  # deepcopy the model, not the Trainer
            base = copy.deepcopy(module).train()
        for mode in modes:
            if time.perf_counter() > deadline:
                break
            try:
                results[mode] = _time_one(base, batch, mode, steps)
            except RuntimeError:  # e.g. float inputs into a bf16 module: this mode cannot run this step
                results[mode] = None
    _CACHE[key] = dict(results)
    return results


def _time_one(base: nn.Module, batch: Any, mode: str, steps: int) -> float | None:
    model = copy.deepcopy(base)
    device_type = next(model.parameters()).device.type
    masters = MasterWeights(model) if mode == "bf16-master" else None
    params = list(masters.parameters()) if masters is not None else list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    context = (lambda: torch.autocast(device_type, dtype=torch.bfloat16, cache_enabled=False)) \
        if mode == "bf16-mixed" else nullcontext
    times = []
    for i in range(steps + 1):  # the first step warms up (allocations, kernel selection)
        start = time.perf_counter()
        with context():
            loss = _loss_of(model, batch)
        if not torch.isfinite(loss.detach()).all():
            return None
        loss.float().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if masters is not None:
            masters.copy_to_model()
        if device_type == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def choose_by_timing(times: dict[str, float | None], min_gain: float = MIN_GAIN) -> tuple[str, str]:
    """The fastest finite mode, and the reason with every measured step time (for the start-up table)."""
    finite = {m: t for m, t in times.items() if t is not None and math.isfinite(t)}
    shown = ", ".join(f"{m} {1000 * t:.1f} ms" if t is not None else f"{m} non-finite" for m, t in times.items())
    if not finite:
        return "32-true", f"no mode gave a finite loss when timed ({shown})"
    best = min(finite, key=finite.get)  # type: ignore[arg-type]
    base = finite.get("32-true")
    if base is not None and best != "32-true" and finite[best] > (1 - min_gain) * base:
        best = "32-true"
    return best, f"timed this model's step on one micro-batch: {shown}"


def auto_mode_for(module: nn.Module, candidates: Sequence[str]) -> tuple[str, str] | None:
    """Time ``candidates`` on one batch of the attached Trainer's training data; ``None`` if there is none."""
    trainer = pl_compat.attached_trainer(module)
    datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
    if datamodule is None or not hasattr(datamodule, "train_dataloader"):
        return None
    with torch.random.fork_rng():  # drawing a batch must not shift the run's data order
        batch = next(iter(datamodule.train_dataloader()))
    if hasattr(datamodule, "on_after_batch_transfer"):
        batch = datamodule.on_after_batch_transfer(batch, 0)
    return choose_by_timing(time_modes(module, batch, candidates))


def _shapes(batch: Any) -> tuple:
    if isinstance(batch, torch.Tensor):
        return (tuple(batch.shape), str(batch.dtype))
    if isinstance(batch, (list, tuple)):
        return tuple(_shapes(b) for b in batch)
    if isinstance(batch, dict):
        return tuple((k, _shapes(v)) for k, v in sorted(batch.items()))
    return (type(batch).__name__,)
