"""LR schedules as plain ``LambdaLR`` builders (Hydra: ``model.scheduler: {_target_: ..., _partial_: true}``).

:func:`warmup_cosine` (linear warm-up, cosine decay to a floor) and :func:`warmup_stable_decay` (warm-up, the peak LR
held, a linear decay placed where the target should be reached: ``experiment=charlm_fast``). Their position resumes
through the scheduler's ``state_dict``; :func:`wsd_factor` is the plain multiplier.
"""
from __future__ import annotations

import math

import torch


def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0,
                  min_lr_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up then cosine decay to ``min_lr_ratio`` of the base LR at ``total_steps``."""
    if warmup_steps < 0 or not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"warmup_steps must be >= 0 and min_lr_ratio in [0, 1], got {warmup_steps}, {min_lr_ratio}")
    total_steps = max(int(total_steps), 1)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def wsd_factor(step: int, total_steps: int, warmup_steps: int = 0, decay_steps: int = 0,
               min_lr_ratio: float = 0.0) -> float:
    """Warm-up, stable, decay: the LR multiplier at optimizer ``step`` (0-based).

    Linear warm-up over ``warmup_steps``, then the peak LR until ``total_steps - decay_steps``, then a
    linear decay to ``min_lr_ratio`` at ``total_steps`` (held there after). Unlike cosine, the LR stays
    at its peak for most of the run, and the decay can be placed where the target should be reached.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_start = total_steps - decay_steps
    if step < decay_start or decay_steps <= 0:
        return 1.0
    progress = min((step - decay_start) / decay_steps, 1.0)
    return 1.0 - (1.0 - min_lr_ratio) * progress


def warmup_stable_decay(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0,
                        decay_fraction: float = 0.2, min_lr_ratio: float = 0.0,
                        horizon: int | None = None) -> torch.optim.lr_scheduler.LambdaLR:
    """The :func:`wsd_factor` schedule as a ``LambdaLR`` (its position resumes through ``state_dict``).

    Args:
        optimizer: The optimizer whose groups' LRs are scaled (each keeps its own peak LR).
        total_steps: Optimizer steps of the run (Lightning's ``estimated_stepping_batches``).
        warmup_steps: Linear warm-up steps.
        decay_fraction: Fraction of the horizon spent in the final linear decay.
        min_lr_ratio: LR at the end of the decay, as a fraction of the peak.
        horizon: Schedule length in optimizer steps if not ``total_steps`` (e.g. decay by step 1500 of a
            3000-step budget).

    Raises:
        ValueError: A negative warm-up, a fraction outside [0, 1] or a ratio outside [0, 1].
    """
    if warmup_steps < 0 or not 0.0 <= decay_fraction <= 1.0 or not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"warmup_stable_decay needs warmup_steps >= 0, decay_fraction and min_lr_ratio in "
                         f"[0, 1]; got {warmup_steps}, {decay_fraction}, {min_lr_ratio}")
    length = max(int(horizon if horizon is not None else total_steps), 1)
    decay_steps = int(round(decay_fraction * length))

    def factor(step: int) -> float:
        return wsd_factor(step, length, warmup_steps, decay_steps, min_lr_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
