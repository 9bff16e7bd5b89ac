"""Bytes of model state (parameters, gradients, optimizer state) per process: the one calculator.

Plain arithmetic after the ZeRO paper (Rajbhandari et al., 2020, section 3), from three facts:
the precision mode's weight dtype and master copy (:func:`lit_speed.precision.modes.spec`), the optimizer's state
bytes per parameter (:func:`lit_speed.optim.state_cost.state_bytes_per_param`, asked for the dtype its state is kept
beside; or a count of whole state tensors), and who holds the optimizer:

* **torch** (no ZeRO): parameters and gradients in the mode's weight dtype; the optimizer keeps its state in the
  weights' dtype, or in float32 next to float32 masters (``bf16-master``);
* **DeepSpeed** (ZeRO, and the stage-0 DeepSpeed engine): a 16-bit mode keeps 16-bit working weights and gradients
  and a float32 master copy plus float32 state in the optimizer; ``32-true`` keeps everything in float32.

With ``N`` processes, stage >= 1 partitions optimizer state (and the master copy) over ``N``, stage >= 2 also
gradients, stage 3 also parameters. Offload moves optimizer state (and, at stage 3, parameters) to host memory.
The planner (:mod:`lit_speed.memory.planner`) and ``ZeroStrategy``'s start-up row both call :func:`model_state_bytes`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from lit_speed.precision.modes import BASELINE, spec


class ParameterCounts(NamedTuple):
    """Parameter elements of a model, each tensor once (tied weights, a module shared by two parents)."""

    trainable: int
    frozen: int

    @property
    def total(self) -> int:
        return self.trainable + self.frozen


def parameter_counts(model: torch.nn.Module) -> ParameterCounts:
    """The one count of ``model``'s parameters (the adapters' start-up row, ``ZeroStrategy``'s memory row, the fit
    check's estimate, the start-up table): trainable (``requires_grad``) and frozen elements, tied tensors once.

    Example::

        parameter_counts(model).trainable  # elements that get a gradient and optimizer state
    """
    unique = {id(p): p for p in model.parameters()}.values()
    trainable = sum(p.numel() for p in unique if p.requires_grad)
    return ParameterCounts(trainable, sum(p.numel() for p in unique) - trainable)


class ZeroLayout(NamedTuple):
    """Where the model state of one process lives: ZeRO stage, what is offloaded, and who holds the optimizer."""

    stage: int = 0
    offload_optimizer: bool = False
    offload_parameters: bool = False
    deepspeed: bool = False


#: The options of ``conf/strategy`` and the layout each one trains in.
STRATEGIES = {"auto": ZeroLayout(), "ddp": ZeroLayout(), "zero1": ZeroLayout(1, deepspeed=True),
              "zero2": ZeroLayout(2, deepspeed=True), "zero2_offload": ZeroLayout(2, True, deepspeed=True),
              "zero3": ZeroLayout(3, deepspeed=True), "zero3_offload": ZeroLayout(3, True, True, deepspeed=True)}
NO_ZERO = ZeroLayout()  # one process or DDP: a torch optimizer holds the state
FLOAT32_BYTES = 4
DEEPSPEED_LOW_BYTES = 2  # DeepSpeed's bf16/fp16 working copies


@dataclass(frozen=True)
class ModelStateBytes:
    """Model-state bytes one process holds; ``host`` is the part of ``params`` + ``optimizer`` offloaded to RAM."""

    params: int
    grads: int
    optimizer: int
    host: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def device(self) -> int:
        """What stays on the training device."""
        return self.total - self.host


def model_state_bytes(n_params: int, precision: str = BASELINE, optimizer_states: float = 2,
                      layout: ZeroLayout = NO_ZERO, world_size: int = 1, frozen_params: int = 0,
                      state_bytes: Callable[[torch.dtype], float] | None = None) -> ModelStateBytes:
    """Per-process model-state bytes.

    Args:
        n_params: Trainable parameter count.
        precision: A precision mode of :data:`lit_speed.precision.modes.TABLE`.
        optimizer_states: State tensors per trainable parameter (Adam 2, SGD-momentum and Lion 1; Muon's mix of
            Muon and AdamW groups gives a fraction): ask the optimizer (:mod:`lit_speed.optim.state_cost`).
        layout: ZeRO stage, offload and whether DeepSpeed holds the optimizer (:data:`STRATEGIES` by option).
        world_size: Processes the model is trained on.
        frozen_params: Parameters that do not train (a frozen base under adapters): they take parameter memory
            (sharded at stage 3) but no gradient and no optimizer state.
        state_bytes: ``dtype -> bytes of optimizer state per parameter`` when the state is kept beside parameters of
            that dtype (``functools.partial(lit_speed.state_bytes_per_param, optimizer)``); replaces
            ``optimizer_states`` x the state dtype's width, for optimizers whose state is not whole tensors (8- and
            4-bit AdamW: codes, block scales, lookup tables).

    Raises:
        ValueError: An unknown precision, a stage outside 0-3, ``world_size < 1`` or a negative count.

    Example::

        model_state_bytes(1_000_000, optimizer_states=2, layout=STRATEGIES["zero2"], world_size=4).device
    """
    mode = spec(precision)
    stage, offload_optimizer, offload_parameters, deepspeed = layout
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be one of (0, 1, 2, 3), got {stage!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if min(n_params, frozen_params, optimizer_states) < 0:
        raise ValueError(f"n_params, frozen_params and optimizer_states must be >= 0, got {n_params}, "
                         f"{frozen_params} and {optimizer_states}")
    if deepspeed:  # 16-bit working copies, float32 masters and state inside the (ZeRO) optimizer
        if mode.deepspeed_as is None:
            raise ValueError(f"precision {precision!r} does not run under DeepSpeed")
        low = mode.compute_dtype.itemsize < FLOAT32_BYTES
        width = DEEPSPEED_LOW_BYTES if low else FLOAT32_BYTES
        master, state_dtype = (FLOAT32_BYTES if low else 0), torch.float32
    else:  # a torch optimizer keeps its state in the weights' dtype, or beside float32 masters
        width = mode.param_bytes
        master, state_dtype = (FLOAT32_BYTES if mode.master_weights else 0), mode.optimizer_dtype
    per_param = state_bytes(state_dtype) if state_bytes is not None else state_dtype.itemsize * optimizer_states
    p, every = n_params, n_params + frozen_params
    params = width * every // (world_size if stage >= 3 else 1)
    grads = width * p // (world_size if stage >= 2 else 1)
    optimizer = int((master + per_param) * p) // (world_size if stage >= 1 else 1)
    host = (optimizer if offload_optimizer else 0) + (params if offload_parameters and stage == 3 else 0)
    return ModelStateBytes(params, grads, optimizer, host)


def state_bytes(n_params: int, precision: str = BASELINE, optimizer_states: float = 2, strategy: str = "auto",
                world_size: int = 1, frozen_params: int = 0,
                optimizer_state_bytes: Callable[[torch.dtype], float] | None = None) -> ModelStateBytes:
    """:func:`model_state_bytes` for a ``conf/strategy`` option (``auto``, ``ddp``, ``zero1`` ... ``zero3_offload``).

    Raises:
        ValueError: An unknown option, or what :func:`model_state_bytes` refuses.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {sorted(STRATEGIES)}, got {strategy!r}")
    return model_state_bytes(n_params, precision, optimizer_states, STRATEGIES[strategy], world_size, frozen_params,
                             optimizer_state_bytes)
