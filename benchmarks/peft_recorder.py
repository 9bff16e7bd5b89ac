"""A callback the fine-tuning benchmark adds to each run (``+callbacks.bench._target_=peft_recorder.BenchRecorder``):
what the run's training state costs and how its val/loss falls with wall time. Writes one JSON at the end of fit."""
from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import psutil
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override


def tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class BenchRecorder(Callback):
    """Trainable/total parameters, gradient and optimizer-state bytes, step times, peak RSS, (wall s, step, val/loss).

    Args:
        out: The JSON file to write.
        warmup_steps: Steps left out of the step-time median (first steps allocate and warm caches).
    """

    def __init__(self, out: str, warmup_steps: int = 5) -> None:
        self.out, self.warmup_steps = Path(out), warmup_steps
        self.t0 = 0.0
        self.rss_at_start = 0
        self.batch_start = 0.0
        self.step_times: list[float] = []
        self.grad_bytes = 0
        self.curve: list[list[float]] = []

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.rss_at_start = psutil.Process().memory_info().rss
        self.t0 = time.perf_counter()

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        self.batch_start = time.perf_counter()

    @override
    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                                 optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self.grad_bytes = max(self.grad_bytes, tensor_bytes(grads))

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step > self.warmup_steps:
            self.step_times.append(time.perf_counter() - self.batch_start)

    @override
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        value = trainer.callback_metrics.get("val/loss")
        if value is not None and not trainer.sanity_checking:
            self.curve.append([round(time.perf_counter() - self.t0, 3), trainer.global_step, float(value)])

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        params = {id(p): p for p in pl_module.parameters()}.values()
        state = [t for opt in trainer.optimizers for s in opt.state.values() for t in s.values()]
        times = sorted(self.step_times)
        self.out.write_text(json.dumps({
            "trainable_params": sum(p.numel() for p in params if p.requires_grad),
            "total_params": sum(p.numel() for p in params),
            "optimizer_state_bytes": tensor_bytes(state),
            "grad_bytes": self.grad_bytes,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "rss_at_train_start_bytes": self.rss_at_start,
            "steps": trainer.global_step,
            "step_time_ms_median": 1000 * times[len(times) // 2] if times else None,
            "train_wall_s": round(time.perf_counter() - self.t0, 3),
            "curve": self.curve,
        }, indent=1))
