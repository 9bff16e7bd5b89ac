"""Validation that is identical in every run it compares: fixed windows, a cadence in training tokens.

A time-to-target race is only fair if every contender is checked the same way: the same validation
windows, at the same points in training (counted in tokens seen, not in steps, so a run with another
batch size is checked as often), and a clock that starts when the process starts (imports, data,
compilation and every validation count: that is what a user waits for).

:class:`TokenCadenceProbe` is the functional core (no Lightning): a hand-written loop calls
:meth:`~TokenCadenceProbe.after_batch` after each training batch. :class:`FixedValidationClock` wires
the same probe to Lightning's hooks.
"""
from __future__ import annotations

import json
import math
import os
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, ContextManager

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import Dataset
from typing_extensions import override

from lit_speed.reporting.time_to_target import target_met


def process_start_time() -> float:
    """Unix time at which this process was launched (the kernel's start time, so imports and Hydra count too).

    On Linux: now minus (the boot clock minus the process's start tick in ``/proc/self/stat``), good to a clock tick
    (10 ms). psutil's ``create_time`` adds ``/proc/stat``'s boot time, a whole second, so it can be off by up to
    1 s (it put a launch 85 ms before the parent started the process); it is the fallback elsewhere, then the
    import time.
    """
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name: field 3 (state) on
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time, in ticks since boot
        return time.time() - max(time.clock_gettime(time.CLOCK_BOOTTIME) - started, 0.0)
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # noqa: BLE001 - a clock must not stop a run
        return _IMPORT_TIME


_IMPORT_TIME = time.time()


@torch.no_grad()
def mean_token_loss(model: Callable[[torch.Tensor], torch.Tensor], dataset: Dataset, batch_size: int = 64,
                    device: torch.device | str = "cpu", context: Callable[[], ContextManager] = nullcontext) -> float:
    """Cross-entropy per target token of ``model`` (logits out) over every ``(x, y)`` window of ``dataset``.

    Windows are taken in order, ``batch_size`` at a time; the loss is computed in float32 and summed in
    float64, so the value does not depend on how the windows are batched.
    """
    total, count = 0.0, 0
    n = len(dataset)  # type: ignore[arg-type]
    for start in range(0, n, batch_size):
        items = [dataset[i] for i in range(start, min(start + batch_size, n))]
        x = torch.stack([a for a, _ in items]).to(device)
        y = torch.stack([b for _, b in items]).to(device)
        with context():
            logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum")
        total += float(loss.double())
        count += y.numel()
    return total / max(count, 1)


class TokenCadenceProbe:
    """Validates every ``every_tokens`` training tokens on a fixed dataset; records val loss vs wall time.

    Args:
        dataset: The fixed validation windows (``(x, y)`` pairs), e.g. ``CharLMDataModule.val_dataset``
            (``None``: set ``probe.dataset`` before the first validation).
        every_tokens: Training tokens between two validations (76,800 = 100 steps of 12 x 64).
        target: Stop at the first validation with loss ``<= target`` (``None``: never stop).
        clock_start: Unix time the clock starts from (default: this process's launch).
        batch_size: Validation batch size (does not change the value, only its cost).
    """

    def __init__(self, dataset: Dataset | None, every_tokens: int, target: float | None = None,
                 clock_start: float | None = None, batch_size: int = 64) -> None:
        if not (isinstance(every_tokens, int) and every_tokens > 0):
            raise ValueError(f"every_tokens must be a positive int (e.g. 76800 = 100 steps x 12 x 64), got "
                             f"{every_tokens!r}")
        self.dataset = dataset
        self.every_tokens = every_tokens
        self.target = target
        self.clock_start = process_start_time() if clock_start is None else clock_start
        self.batch_size = batch_size
        self.tokens = 0
        self.next_check = every_tokens
        self.history: list[dict[str, float]] = []
        self.time_to_target_s: float | None = None
        self.target_step: int | None = None
        self.target_tokens: int | None = None

    def elapsed(self) -> float:
        return time.time() - self.clock_start

    def after_batch(self, n_tokens: int, step: int, evaluate: Callable[[], float]) -> bool:
        """Count ``n_tokens``; validate with ``evaluate()`` when a cadence point is passed. True: target met."""
        self.tokens += int(n_tokens)
        if self.tokens < self.next_check:
            return False
        while self.next_check <= self.tokens:
            self.next_check += self.every_tokens
        value = evaluate()
        record = {"tokens": self.tokens, "step": step, "wall_s": round(self.elapsed(), 3), "val_loss": value}
        self.history.append(record)
        met = self.target is not None and target_met(value, self.target, "min")
        if met and self.time_to_target_s is None:
            self.time_to_target_s, self.target_step, self.target_tokens = record["wall_s"], step, self.tokens
        return met

    def summary(self) -> dict[str, Any]:
        finite = [h["val_loss"] for h in self.history if math.isfinite(h["val_loss"])]
        windows = len(self.dataset) if self.dataset is not None else 0  # type: ignore[arg-type]
        return {"target": self.target, "every_tokens": self.every_tokens, "windows": windows,
                "reached": self.time_to_target_s is not None, "time_to_target_s": self.time_to_target_s,
                "target_step": self.target_step, "target_tokens": self.target_tokens,
                "best_val_loss": min(finite) if finite else None, "tokens": self.tokens, "history": self.history}


class FixedValidationClock(Callback):
    """Lightning wiring of :class:`TokenCadenceProbe`: the benchmark's instrument, the same in every variant.

    Validates ``pl_module(x)`` (a model that returns logits) under the precision plugin's forward context
    on the datamodule's ``val_dataset`` every ``every_tokens`` training tokens (``batch[0].numel()`` per
    batch), stops training at the target if ``stop``, and writes the probe's summary to ``out_path``.

    Args:
        target: val loss to reach.
        every_tokens: Training tokens between two validations.
        out_path: JSON file written after every validation (and at the end).
        stop: Stop training at the first validation that meets the target.

    Example::

        # python scripts/train.py experiment=charlm_fast \
        #     +callbacks.clock._target_=lit_speed.reporting.fixed_validation.FixedValidationClock \
        #     +callbacks.clock.target=1.8 +callbacks.clock.every_tokens=76800 +callbacks.clock.out_path=clock.json
    """

    def __init__(self, target: float, every_tokens: int = 76_800, out_path: str | None = None,
                 stop: bool = True) -> None:
        self.target = float(target)
        self.every_tokens = int(every_tokens)
        self.out_path = out_path
        self.stop = stop
        self.probe: TokenCadenceProbe | None = None

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        dataset = getattr(trainer.datamodule, "val_dataset", None)
        if dataset is None:
            raise ValueError("FixedValidationClock needs a datamodule with a val_dataset of (x, y) windows "
                             "(e.g. CharLMDataModule). Fix: use CharLMDataModule or drop this callback.")
        self.probe = TokenCadenceProbe(dataset, self.every_tokens, self.target)

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        assert self.probe is not None
        x = batch[0] if isinstance(batch, (tuple, list)) else batch

        def evaluate() -> float:
            was_training = pl_module.training
            pl_module.eval()
            try:
                return mean_token_loss(pl_module, self.probe.dataset, self.probe.batch_size, pl_module.device,
                                       trainer.precision_plugin.forward_context)
            finally:
                pl_module.train(was_training)

        met = self.probe.after_batch(x.numel(), trainer.global_step, evaluate)
        if len(self.probe.history) and self.probe.history[-1]["tokens"] == self.probe.tokens:
            last = self.probe.history[-1]
            rank_zero_info(f"FixedValidationClock: step {last['step']} tokens {last['tokens']} "
                           f"{last['wall_s']:.1f} s val_loss {last['val_loss']:.4f}")
            self._write()
        if met and self.stop:
            trainer.should_stop = True

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._write()

    def _write(self) -> None:
        if self.out_path and self.probe is not None:
            Path(self.out_path).write_text(json.dumps(self.probe.summary()))

    def final_summary(self) -> dict[str, Any]:
        return self.probe.summary() if self.probe is not None else {}
