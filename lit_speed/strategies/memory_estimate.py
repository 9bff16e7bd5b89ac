"""Per-rank memory of model states under ZeRO: DeepSpeed's formulas, and a measurement of the real tensors.

The formulas are those of the ZeRO paper (Rajbhandari et al., 2020) that DeepSpeed's
``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_model_states_mem_needs`` implement:
with ``P`` parameters, ``N`` data-parallel ranks and Adam,

* mixed precision (bf16/fp16): 2P bytes of low-precision weights, 2P of gradients, 12P of optimizer state
  (fp32 master weights + exp_avg + exp_avg_sq);
* fp32: 4P of weights, 4P of gradients, 8P of optimizer state (exp_avg + exp_avg_sq);
* stage 1 shards the optimizer state over ``N``, stage 2 also the gradients, stage 3 also the weights;
* offload moves the (sharded) optimizer state, and at stage 3 the weights, to host memory.

Activations and temporary buckets are not model states and are not counted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lit_speed.compat import lightning as pl_compat

_WEIGHT_BYTES = {"32-true": 4, "bf16-mixed": 2, "bf16-true": 2, "16-mixed": 2, "16-true": 2}


@dataclass(frozen=True)
class ZeroMemoryEstimate:
    """Bytes of model states held by one rank, split by where they live."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    offloaded_bytes: int  # the part of the three above that lives in host (CPU) memory

    @property
    def total_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def device_bytes(self) -> int:
        return self.total_bytes - self.offloaded_bytes


def estimate_zero_memory(num_params: int, stage: int, world_size: int = 1, precision: str = "32-true",
                         offload_optimizer: bool = False, offload_parameters: bool = False,
                         optimizer_states_per_param: int = 2) -> ZeroMemoryEstimate:
    """Per-rank bytes of weights, gradients and optimizer state under a ZeRO stage.

    Args:
        num_params: Trainable parameters of the model.
        stage: 0 (plain data parallel, the baseline), 1, 2 or 3.
        world_size: Data-parallel ranks sharing the states.
        precision: A Lightning precision literal; mixed/half precisions keep an fp32 master copy.
        offload_optimizer: Optimizer state lives in host memory.
        offload_parameters: Weights live in host memory (stage 3 only).
        optimizer_states_per_param: fp32 state tensors per parameter (2 for Adam, 1 for SGD with momentum).

    Raises:
        ValueError: If ``stage``, ``world_size``, ``precision`` or ``num_params`` is out of range.

    Example::

        >>> estimate_zero_memory(1_000_000, stage=2, world_size=2, precision="bf16-mixed").total_bytes
        9000000
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be one of (0, 1, 2, 3), got {stage!r}")
    if world_size < 1 or num_params < 0:
        raise ValueError(f"world_size must be >= 1 and num_params >= 0, got {world_size} and {num_params}")
    if precision not in _WEIGHT_BYTES:
        raise ValueError(f"precision must be one of {tuple(_WEIGHT_BYTES)}, got {precision!r}")
    weight = _WEIGHT_BYTES[precision]
    master = 0 if weight == 4 else 4  # low-precision training keeps an fp32 master copy in the optimizer
    params = weight * num_params
    grads = weight * num_params
    optimizer = (master + 4 * optimizer_states_per_param) * num_params
    if stage >= 1:
        optimizer //= world_size
    if stage >= 2:
        grads //= world_size
    if stage >= 3:
        params //= world_size
    offloaded = (optimizer if offload_optimizer else 0) + (params if offload_parameters and stage == 3 else 0)
    return ZeroMemoryEstimate(params, grads, optimizer, offloaded)


def format_bytes(n: int) -> str:
    """``1536 -> '1.5 KiB'``: binary units, one decimal."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _state_tensors(optimizer: Any) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    for state in getattr(optimizer, "state", {}).values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return tensors


def measured_optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the optimizer-state tensors (e.g. Adam's ``exp_avg``/``exp_avg_sq``) this rank really holds.

    Unwraps DeepSpeed's ZeRO optimizer (``.optimizer``) down to the torch optimizer and sums its ``state``
    tensors; under ZeRO 1/2/3 those are allocated for this rank's flat partition only. Scalar ``step``
    counters are not counted.

    Args:
        optimizer: A torch optimizer, a DeepSpeed ZeRO optimizer, or a Lightning optimizer wrapper.
    """
    seen: set[int] = set()
    inner = optimizer
    while inner is not None and id(inner) not in seen:
        seen.add(id(inner))
        tensors = _state_tensors(inner)
        if tensors:
            return sum(t.numel() * t.element_size() for t in tensors)
        inner = pl_compat.wrapped_optimizer(inner)
    return 0
