"""How many state tensors per parameter an optimizer keeps: declared where it is defined, asked by the planner.

An optimizer declares its cost with a ``state_tensors_per_param()`` method (the
:class:`~lit_speed.interfaces.OptimizerStateCost` protocol): lit_speed's :class:`~lit_speed.optim.lion.Lion`,
:class:`~lit_speed.optim.batched_muon.BatchedMuon`, :class:`~lit_speed.optim.muon.MuonAdamW` and
:class:`~lit_speed.optim.cpu_adam.CPUAdam` do, and so can yours. torch's and DeepSpeed's optimizers cannot carry the
method, so their costs, read from their ``step`` code (torch 2.13, DeepSpeed 0.19), are the one table here.
:func:`state_tensors_per_param` asks the optimizer first, then the table; ``None`` means unknown (the planner then
counts the state a real step allocates).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch

from lit_speed.interfaces import OptimizerStateCost

GroupCount = Callable[[dict[str, Any]], float]

#: State tensors per parameter of torch's optimizers (``step`` scalars not counted), by class and param group.
TORCH_STATES: dict[type, GroupCount] = {
    torch.optim.Adam: lambda g: 2 + bool(g.get("amsgrad")),       # exp_avg, exp_avg_sq (+ max_exp_avg_sq)
    torch.optim.AdamW: lambda g: 2 + bool(g.get("amsgrad")),
    torch.optim.SGD: lambda g: float(g.get("momentum", 0) != 0),   # momentum_buffer
    torch.optim.Adagrad: lambda g: 1,                              # sum
    torch.optim.RMSprop: lambda g: 1 + (g.get("momentum", 0) != 0) + bool(g.get("centered")),
    torch.optim.Adamax: lambda g: 2,                               # exp_avg, exp_inf
    torch.optim.NAdam: lambda g: 2,
    torch.optim.RAdam: lambda g: 2,
    torch.optim.Muon: lambda g: 1,                                 # momentum_buffer
}
#: DeepSpeed's optimizers by class name (importing DeepSpeed to compare classes would cost seconds).
DEEPSPEED_STATES = {"DeepSpeedCPUAdam": 2.0, "FusedAdam": 2.0, "DeepSpeedCPULion": 1.0, "DeepSpeedCPUAdagrad": 1.0,
                    "FusedLamb": 2.0}


def per_element(parts: Sequence[tuple[Iterable[dict[str, Any]], float | GroupCount]]) -> float:
    """State tensors per parameter over ``(param groups, tensors per element of those groups)`` pairs, weighted by
    the groups' element counts (MuonAdamW: its Muon groups keep 1, its AdamW groups 2)."""
    total = states = 0.0
    for groups, count in parts:
        for group in groups:
            n = sum(p.numel() for p in group["params"])
            total += n
            states += n * (count(group) if callable(count) else count)
    return states / total if total else 0.0


def state_tensors_per_param(optimizer: Any) -> float | None:
    """The state tensors per parameter ``optimizer`` keeps: its own declaration, else the table; ``None``: unknown.

    Args:
        optimizer: A built optimizer (a ``LightningOptimizer`` or a wrapper exposing ``.optimizer`` is unwrapped).

    Example::

        state_tensors_per_param(torch.optim.AdamW(model.parameters()))  # 2.0
    """
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = inner
    if isinstance(optimizer, OptimizerStateCost):
        return float(optimizer.state_tensors_per_param())
    for cls in type(optimizer).__mro__:
        if cls in TORCH_STATES:
            return per_element([(optimizer.param_groups, TORCH_STATES[cls])])
        if cls.__name__ in DEEPSPEED_STATES:
            return DEEPSPEED_STATES[cls.__name__]
    return None
