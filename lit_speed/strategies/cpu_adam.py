"""DeepSpeed's CPU Adam, safe to hand to Lightning outside a DeepSpeed engine."""
from __future__ import annotations

from typing import Any

from deepspeed.ops.adam import DeepSpeedCPUAdam


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

    Example::

        optimizer = CPUAdam(model.parameters(), lr=1e-3, adamw_mode=True)
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._owner_id = id(self)

    def __del__(self) -> None:
        if self.__dict__.get("_owner_id") == id(self):
            super().__del__()
