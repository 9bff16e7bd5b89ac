"""DeepSpeed's CPU Adam, safe to hand to Lightning outside a DeepSpeed engine."""
from __future__ import annotations

from typing import Any

import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam

from lit_speed.optim.state_cost import whole_tensor_bytes


class CPUAdam(DeepSpeedCPUAdam):
    """:class:`deepspeed.ops.adam.DeepSpeedCPUAdam` that only frees its C++ state from the object that created it.

    Lightning 2.6.6 wraps every optimizer in a ``LightningOptimizer`` whose class subclasses the optimizer's and
    whose ``__dict__`` copies it; when such a wrapper is garbage-collected it runs ``DeepSpeedCPUAdam.__del__``,
    which destroys the C++ optimizer the original still steps, and the next step segfaults (seen with
    ``strategy=auto``/``ddp`` + DeepSpeedCPUAdam). Under ZeroStrategy Lightning wraps DeepSpeed's ZeRO optimizer
    instead, so both classes behave the same there.

    Args:
        *args: As :class:`~deepspeed.ops.adam.DeepSpeedCPUAdam` (``model_params, lr, betas, eps, weight_decay,
            adamw_mode, ...``).
        **kwargs: As :class:`~deepspeed.ops.adam.DeepSpeedCPUAdam`.

    It also resumes bitwise. The C++ optimizer keeps ``beta**step`` for the bias correction as a running product
    (DeepSpeed 0.19 ``Adam_Optimizer::IncrementStep``: one multiplication per step) and recomputes it with
    ``std::pow`` when the step it is given jumps, as it does on the first step after a resume: the float32 power
    and the product differ in the last bit, and the whole run drifts from the uninterrupted one (~3e-8 after
    one step, all tensors). :meth:`load_state_dict` therefore replays the product up to the restored step on a
    one-element tensor (one C++ call per step: ~1 s per 10^5 steps).

    Example::

        optimizer = CPUAdam(model.parameters(), lr=1e-3, adamw_mode=True)
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._owner_id = id(self)

    def state_bytes_per_param(self, dtype: torch.dtype | None = None) -> float:
        """Adam's two moments per parameter (``exp_avg``, ``exp_avg_sq``), in float32 whatever the parameters' dtype
        (DeepSpeed's default ``fp32_optimizer_states=True``), else like the parameters."""
        if self.fp32_optimizer_states:
            return 2.0 * torch.float32.itemsize
        return whole_tensor_bytes([(self.param_groups, 2)], dtype)

    def __del__(self) -> None:
        if self.__dict__.get("_owner_id") == id(self):
            super().__del__()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        steps = [int(s["step"]) for s in self.state.values() if isinstance(s, dict) and "step" in s]
        if steps and self.param_groups:
            replay_step_product(self, max(steps))


def replay_step_product(optimizer: DeepSpeedCPUAdam, steps: int) -> None:
    """Bring the C++ optimizer's running ``beta**step`` product to ``steps`` the way the uninterrupted run did:
    one update per step, 1..steps, on a throw-away one-element tensor (its own state, not the model's)."""
    group = optimizer.param_groups[0]
    beta1, beta2 = group["betas"]
    dummy = [torch.zeros(1) for _ in range(4)]  # param, grad, exp_avg, exp_avg_sq
    for step in range(1, steps + 1):
        optimizer.ds_opt_adam.adam_update(optimizer.opt_id, step, group["lr"], beta1, beta2, group["eps"],
                                          group["weight_decay"], group["bias_correction"], *dummy)
