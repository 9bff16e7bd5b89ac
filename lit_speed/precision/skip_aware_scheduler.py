"""An LR-scheduler wrapper that does not step when the optimizer step it follows was skipped.

Lightning steps ``interval="step"`` schedulers after every optimizer step, including the ones a loss scaler
or a non-finite guard skipped, so warm-up and decay run ahead of the weights (Lightning #18828, #5558).
The wrapper forwards everything else (``state_dict``, ``optimizer``, ``get_last_lr``, ...) to the scheduler,
so checkpoints hold the plain scheduler's state.
"""
from __future__ import annotations

from typing import Any, Callable


class SkipAwareScheduler:
    """Wraps ``scheduler``; ``step()`` is a no-op while ``skipped()`` returns True.

    Args:
        scheduler: Any torch LR scheduler (``LRScheduler`` or ``ReduceLROnPlateau``).
        skipped: Returns whether the most recent optimizer step was skipped.

    Example::

        config.scheduler = SkipAwareScheduler(config.scheduler, lambda: plugin.last_step_skipped)
    """

    def __init__(self, scheduler: Any, skipped: Callable[[], bool]) -> None:
        self.scheduler = scheduler
        self._skipped = skipped
        self.held_steps = 0  # scheduler steps withheld because their optimizer step was skipped

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self._skipped():
            self.held_steps += 1
            return
        self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        # only called for attributes not found on the wrapper itself
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"SkipAwareScheduler({self.scheduler!r})"


def unwrap(scheduler: Any) -> Any:
    """The scheduler inside any number of wrappers."""
    while isinstance(scheduler, SkipAwareScheduler):
        scheduler = scheduler.scheduler
    return scheduler
