"""Bytes of model state (parameters, gradients, optimizer state) per precision, ZeRO stage, offload and world size.

Plain arithmetic after the ZeRO paper (Rajbhandari et al., 2020, section 3): with ``P`` parameters,
``N`` processes and stage ``s``, stage >= 1 partitions optimizer state (and the fp32 master copy) over
``N``, stage >= 2 also gradients, stage 3 also parameters. Offload moves optimizer state (and, for
``*_offload`` stage 3, parameters) to host memory.
"""
from __future__ import annotations

from dataclasses import dataclass

# bytes per parameter element for each Lightning precision literal
PARAM_BYTES = {"32-true": 4, "bf16-mixed": 4, "16-mixed": 4, "bf16-true": 2, "16-true": 2}
# state tensors per parameter kept by each optimizer option in conf/optimizer
OPTIMIZER_STATES = {"adamw": 2, "adamw_fused": 2, "adamw_base": 2, "cpu_adam": 2, "sgd": 1, "lion": 1}
# strategy option (conf/strategy) -> (ZeRO stage, optimizer offloaded, parameters offloaded)
STRATEGIES = {"auto": (0, False, False), "ddp": (0, False, False), "zero1": (1, False, False),
              "zero2": (2, False, False), "zero2_offload": (2, True, False), "zero3": (3, False, False),
              "zero3_offload": (3, True, True)}


@dataclass(frozen=True)
class StateBytes:
    """Model-state bytes per process, split by where they live."""

    params: int
    grads: int
    optimizer: int
    host: int  # offloaded optimizer state / parameters (host RAM, per process)

    @property
    def device(self) -> int:
        return self.params + self.grads + self.optimizer


def state_bytes(n_params: int, precision: str = "32-true", optimizer_states: int = 2, strategy: str = "auto",
                world_size: int = 1, frozen_params: int = 0) -> StateBytes:
    """Per-process model-state bytes.

    Args:
        n_params: Trainable parameter count.
        frozen_params: Parameters that do not train (a frozen base under adapters): they take parameter memory
            (sharded at stage 3) but no gradient and no optimizer state.
        precision: Lightning precision literal.
        optimizer_states: State tensors per parameter (Adam 2, SGD-momentum 1, Lion 1).
        strategy: Option of ``conf/strategy`` (``auto``, ``ddp``, ``zero1`` ... ``zero3_offload``).
        world_size: Processes the model is trained on.

    Raises:
        ValueError: An unknown precision or strategy, or ``world_size < 1``.

    Example::

        state_bytes(1_000_000, "bf16-mixed", 2, "zero2", world_size=4).device
    """
    if precision not in PARAM_BYTES:
        raise ValueError(f"precision must be one of {sorted(PARAM_BYTES)}, got {precision!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {sorted(STRATEGIES)}, got {strategy!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    stage, offload_optimizer, offload_params = STRATEGIES[strategy]
    if frozen_params < 0:
        raise ValueError(f"frozen_params must be >= 0, got {frozen_params}")
    p, all_params = n_params, n_params + frozen_params
    if stage == 0:  # torch optimizers keep their state in the parameters' dtype
        width = PARAM_BYTES[precision]
        return StateBytes(params=width * all_params, grads=width * p, optimizer=width * optimizer_states * p, host=0)
    # DeepSpeed: mixed precision keeps 16-bit working params/grads plus an fp32 master copy in the optimizer
    mixed = precision != "32-true"
    width = 2 if mixed else 4
    optimizer = (4 * p if mixed else 0) + 4 * optimizer_states * p
    params = width * all_params // (world_size if stage >= 3 else 1)
    grads = width * p // (world_size if stage >= 2 else 1)
    optimizer //= world_size
    host = 0
    if offload_optimizer:
        host, optimizer = optimizer, 0
    if offload_params:
        host, params = host + params, 0
    return StateBytes(params=params, grads=grads, optimizer=optimizer, host=host)
