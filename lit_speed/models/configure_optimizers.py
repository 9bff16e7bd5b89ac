"""The optimizer and LR-schedule wiring the bundled LightningModules share: parameter groups and
``configure_optimizers`` built from the Hydra ``optimizer`` and ``scheduler`` partials."""
from __future__ import annotations

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


def configure_optimizers(module: "torch.nn.Module", optimizer: OptimizerFactory | None,
                         scheduler: Callable[..., Any] | None, weight_decay: float,
                         total_steps: int, strategy: Any = None) -> Any:
    """Build the ``configure_optimizers`` return value from Hydra partials (``strategy``: refuse what cannot run)."""
    if optimizer is None:
        raise ValueError(f"{type(module).__name__}(optimizer=None): optimizer is not set: pass a partial, e.g. "
                         "functools.partial(torch.optim.AdamW, lr=1e-3) (in Hydra: optimizer=adamw)")
    wants_names = bool(getattr(getattr(optimizer, "func", optimizer), "wants_param_names", False))
    from lit_speed import check_zero_optimizer, strategy_facts

    if strategy_facts(strategy).deepspeed:  # an optimizer that declares it cannot step ZeRO (Muon, low-bit AdamW)
        check_zero_optimizer(optimizer, type(strategy).__name__)
    opt = optimizer(param_groups(module, weight_decay, names=wants_names))
    if scheduler is None:
        return opt
    sched = scheduler(opt, total_steps=total_steps)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}
