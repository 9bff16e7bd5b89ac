"""How many bytes of state per parameter an optimizer keeps: declared where it is defined, asked by the planner.

An optimizer declares its cost with a ``state_bytes_per_param(dtype=None)`` method (the
:class:`~lit_speed.interfaces.OptimizerStateCost` protocol): lit_speed's :class:`~lit_speed.optim.lion.Lion`,
:class:`~lit_speed.optim.batched_muon.BatchedMuon`, :class:`~lit_speed.optim.muon.MuonAdamW`,
:class:`~lit_speed.optim.cpu_adam.CPUAdam` and the low-bit AdamWs (:mod:`lit_speed.optim.low_bit`, whose state is
not whole tensors: 8- or 4-bit codes, their block scales and lookup tables) do, and so can yours. torch's and
DeepSpeed's optimizers cannot carry the method, so their costs, read from their ``step`` code (torch 2.13, DeepSpeed
0.19), are the one table here, in whole state tensors. :func:`state_bytes_per_param` asks the optimizer first, then
the table; ``None`` means unknown (the planner then counts the state a real step allocates).

The bytes depend on the dtype the parameters are held in (a torch optimizer's state is ``zeros_like(param)``), so
the question takes one: ``None`` asks about the parameters as they are now; the planner and ``ZeroStrategy`` ask
about the dtype a precision mode keeps the state in. Nothing is allocated to answer: an optimizer built on
meta-device parameters answers the same.
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
#: DeepSpeed's optimizers by class name (importing DeepSpeed to compare classes would cost seconds): state tensors
#: per parameter, always float32 (``fp32_optimizer_states=True``, their default).
DEEPSPEED_STATES = {"DeepSpeedCPUAdam": 2.0, "FusedAdam": 2.0, "DeepSpeedCPULion": 1.0, "DeepSpeedCPUAdagrad": 1.0,
                    "FusedLamb": 2.0}
FLOAT32_BYTES = 4


def whole_tensor_bytes(parts: Sequence[tuple[Iterable[dict[str, Any]], float | GroupCount]],
                       dtype: torch.dtype | None = None) -> float:
    """Bytes of state per parameter for states that are whole tensors like their parameter (``zeros_like``), over
    ``(param groups, tensors per element of those groups)`` pairs, weighted by element count (MuonAdamW: its Muon
    groups keep 1 tensor, its AdamW groups 2). ``dtype``: the parameters' dtype (``None``: each one's own)."""
    total = kept = 0.0
    for groups, count in parts:
        for group in groups:
            tensors = count(group) if callable(count) else count
            for p in group["params"]:
                total += p.numel()
                kept += p.numel() * tensors * (dtype or p.dtype).itemsize
    return kept / total if total else 0.0


def _unwrapped(optimizer: Any) -> Any:
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        return inner
    return optimizer


def state_bytes_per_param(optimizer: Any, dtype: torch.dtype | None = None) -> float | None:
    """The bytes of state per trainable parameter ``optimizer`` keeps: its own declaration, else the table;
    ``None``: unknown. Scalars (``step``) are not counted.

    Args:
        optimizer: A built optimizer (a ``LightningOptimizer`` or a wrapper exposing ``.optimizer`` is unwrapped).
        dtype: The dtype the parameters are held in when it steps (``None``: the dtypes they have now).

    Example::

        state_bytes_per_param(torch.optim.AdamW(model.parameters()))                  # 8.0 (two float32 moments)
        state_bytes_per_param(torch.optim.AdamW(model.parameters()), torch.bfloat16)  # 4.0
    """
    optimizer = _unwrapped(optimizer)
    if isinstance(optimizer, OptimizerStateCost):
        return float(optimizer.state_bytes_per_param(dtype))
    legacy = getattr(optimizer, "state_tensors_per_param", None)  # a declaration written before bytes: whole tensors
    if callable(legacy) and isinstance(optimizer, torch.optim.Optimizer):
        return whole_tensor_bytes([(optimizer.param_groups, float(legacy()))], dtype)
    for cls in type(optimizer).__mro__:
        if cls in TORCH_STATES:
            return whole_tensor_bytes([(optimizer.param_groups, TORCH_STATES[cls])], dtype)
        if cls.__name__ in DEEPSPEED_STATES:
            return DEEPSPEED_STATES[cls.__name__] * FLOAT32_BYTES
    return None


def state_tensors_per_param(optimizer: Any) -> float | None:
    """Float32-equivalent state tensors per parameter: :func:`state_bytes_per_param` at float32 / 4 (AdamW 2.0, Lion
    1.0, an 8-bit AdamW ~0.51). Kept for callers written before the bytes; new code asks the bytes."""
    found = state_bytes_per_param(optimizer, torch.float32)
    return None if found is None else found / FLOAT32_BYTES
