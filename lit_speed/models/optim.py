"""Optimizer and LR-schedule wiring shared by the bundled LightningModules."""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

OptimizerFactory = Callable[..., torch.optim.Optimizer]


def param_groups(module: nn.Module, weight_decay: float, names: bool = False) -> list[dict[str, Any]]:
    """Decay matrices and embeddings only; biases and norm weights are not decayed (as in nanoGPT).

    ``names=True`` adds each group's ``param_names`` (for optimizers that split by name, e.g. Muon).
    """
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    groups = []
    for keep, wd in ((lambda p: p.dim() >= 2, weight_decay), (lambda p: p.dim() < 2, 0.0)):
        chosen = [(n, p) for n, p in named if keep(p)]
        group: dict[str, Any] = {"params": [p for _, p in chosen], "weight_decay": wd}
        if names:
            group["param_names"] = [n for n, _ in chosen]
        groups.append(group)
    # no empty group: with frozen parameters (adapters) one may be empty, and DeepSpeed drops empty groups, which
    # leaves an LR schedule with one entry per group out of step with the optimizer
    return [g for g in groups if g["params"]]


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


def configure_optimizers(module: "torch.nn.Module", optimizer: OptimizerFactory | None,
                         scheduler: Callable[..., Any] | None, weight_decay: float,
                         total_steps: int, strategy: Any = None) -> Any:
    """Build the ``configure_optimizers`` return value from Hydra partials (``strategy``: refuse what cannot run)."""
    if optimizer is None:
        raise ValueError(f"{type(module).__name__}(optimizer=None): optimizer is not set: pass a partial, e.g. "
                         "functools.partial(torch.optim.AdamW, lr=1e-3) (in Hydra: optimizer=adamw)")
    wants_names = bool(getattr(getattr(optimizer, "func", optimizer), "wants_param_names", False))
    if wants_names and strategy is not None and "DeepSpeedStrategy" in {c.__name__ for c in type(strategy).__mro__}:
        raise ValueError(f"{type(module).__name__}(optimizer=MuonAdamW): MuonAdamW cannot run under a DeepSpeed "
                         "ZeRO strategy: ZeRO flattens parameters into 1-D partitions (and offload steps on the CPU "
                         "with its own Adam), so Muon's 2-D matrices do not exist there. Fix: Trainer(strategy='auto' "
                         "or 'ddp') with MuonAdamW, or keep ZeRO with AdamW (or DeepSpeedCPUAdam for offload).")
    opt = optimizer(param_groups(module, weight_decay, names=wants_names))
    if scheduler is None:
        return opt
    sched = scheduler(opt, total_steps=total_steps)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}
