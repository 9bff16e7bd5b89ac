"""Validate as often as a time budget allows on this machine: the cadence follows measured costs, not a constant.

How often to validate is a trade between seeing the curve and paying for it. A fixed ``val_check_interval`` costs
a different share of the run on every machine and model (a validation pass is forward-only over a fixed set, a
training batch is forward, backward and an optimizer step; precision, threads and the optimizer move the ratio).
:func:`interval_for_budget` is the rule: the smallest interval (in training batches) at which validation takes at
most ``max_fraction`` of the wall time; :class:`ValidationBudget` measures both costs during the run's first
validation and sets the Trainer's cadence from then on.
"""
from __future__ import annotations

import math
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lit_speed.tuning import on_rank_zero


def interval_for_budget(val_seconds: float, batch_seconds: float, max_fraction: float, minimum: int = 1,
                        maximum: int | None = None) -> int:
    """Training batches between validations so that ``val / (val + interval * batch) <= max_fraction``.

    Raises:
        ValueError: A fraction outside (0, 1) or a non-positive batch time.
    """
    if not 0.0 < max_fraction < 1.0:
        raise ValueError(f"ValidationBudget(max_fraction={max_fraction!r}): max_fraction must be in (0, 1), "
                         f"got {max_fraction!r}")
    if batch_seconds <= 0:
        raise ValueError(f"batch_seconds must be > 0, got {batch_seconds}")
    needed = math.ceil(val_seconds * (1.0 - max_fraction) / (max_fraction * batch_seconds))
    needed = max(minimum, needed)
    return min(needed, maximum) if maximum is not None else needed


class ValidationBudget(Callback):
    """Sets ``val_check_interval`` (in training batches) after the first validation so that validation costs at
    most ``max_fraction`` of the run's wall time on this machine.

    The first validation runs at the configured ``val_check_interval``; its wall time and the median training
    batch time before it give the interval (:func:`interval_for_budget`, clipped to ``[min_interval,
    max_interval]``), which rank 0 decides for every process. The interval is saved in checkpoints and a
    resume keeps it (validation, and the checkpoints it triggers, then fall on the same batches).

    Args:
        max_fraction: The largest share of wall time validation may take (0.05 = 5%).
        min_interval: Never validate more often than every this many training batches.
        max_interval: Never less often than every this many (``None``: no limit).

    Raises:
        ValueError: A fraction outside (0, 1), or intervals that are not ``1 <= min <= max``.

    Example::

        trainer = Trainer(val_check_interval=100, check_val_every_n_epoch=None,
                          callbacks=[ValidationBudget(max_fraction=0.05)])
    """

    def __init__(self, max_fraction: float = 0.05, min_interval: int = 1, max_interval: int | None = None) -> None:
        interval_for_budget(0.0, 1.0, max_fraction)  # validates max_fraction
        if min_interval < 1 or (max_interval is not None and max_interval < min_interval):
            raise ValueError(f"ValidationBudget(min_interval={min_interval!r}): needs 1 <= min_interval <= "
                             f"max_interval, got min_interval={min_interval!r}, max_interval={max_interval!r}")
        self.max_fraction, self.min_interval, self.max_interval = max_fraction, min_interval, max_interval
        self.interval: int | None = None
        self.reason = "not decided yet: measured at the first validation"
        self._batch_times: list[float] = []
        self._batch_start = 0.0
        self._val_start = 0.0

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.interval is not None:  # restored from a checkpoint
            trainer.val_check_batch = self.interval

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        self._batch_start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.interval is None:
            self._batch_times.append(time.perf_counter() - self._batch_start)

    @override
    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._val_start = time.perf_counter()

    @override
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.interval is not None or trainer.sanity_checking or len(self._batch_times) < 2:
            return
        val_s = time.perf_counter() - self._val_start
        times = sorted(self._batch_times[1:])  # the first batch pays one-off set-up costs
        batch_s = times[len(times) // 2]
        self.interval, self.reason = on_rank_zero(lambda: (
            interval_for_budget(val_s, batch_s, self.max_fraction, self.min_interval, self.max_interval),
            f"one validation {val_s:.2f} s, one training batch {1000 * batch_s:.1f} ms (median of {len(times)}): "
            f"validation <= {self.max_fraction:.0%} of the wall time"), trainer)  # rank 0's for every process
        trainer.val_check_batch = self.interval
        rank_zero_info(f"ValidationBudget: val_check_interval -> {self.interval} training batches ({self.reason})")

    def describe(self) -> dict[str, str]:
        return {"validation budget": f"<= {self.max_fraction:.0%} of wall time: the interval is set from the first "
                                     f"validation's measured cost"}

    def final_summary(self) -> dict[str, Any]:
        return {"interval": self.interval, "reason": self.reason}

    def state_dict(self) -> dict[str, Any]:
        return {"interval": self.interval, "reason": self.reason}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("interval") is not None:
            self.interval = int(state_dict["interval"])
            self.reason = f"restored from the checkpoint: {state_dict.get('reason', '')}"
