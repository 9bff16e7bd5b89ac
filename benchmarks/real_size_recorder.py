"""A callback ``bench_real_size.py`` and ``bench_sft.py`` add to lit_speed's rows (``+callbacks.bench._target_=
real_size_recorder.StepRecorder``): the loss and seconds of every training batch, the SHA-256 of the first batch (and
for ``data=sft`` batches the positions each computed and the targets it trained), as the peers
(``real_size_peers.py``) record them, and where the step's memory goes (``memory_breakdown.py``, measured at the
same points as in the peers), written as one JSON at the end of fit."""
from __future__ import annotations

import contextlib
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from memory_breakdown import Breakdown
from typing_extensions import override


class StepRecorder(Callback):
    """Per-batch loss and seconds, the first batch's hash.

    Args:
        out: The JSON file to write.
    """

    def __init__(self, out: str) -> None:
        self.out = out
        self.record: dict[str, Any] = {"step_s": [], "loss": [], "first_batch_sha": None, "positions": [],
                                       "real_positions": [], "trained": []}
        self._start = 0.0
        self._cuda: torch.device | None = None
        self._cuda_peak = 0
        self.breakdown = Breakdown()
        self._forward = contextlib.ExitStack()

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        x = batch["input_ids"] if isinstance(batch, dict) else batch[0] if isinstance(batch, (list, tuple)) else batch
        if self.record["first_batch_sha"] is None:
            self.record["first_batch_sha"] = hashlib.sha256(x.cpu().numpy().tobytes()).hexdigest()[:16]
        if isinstance(batch, dict):  # data=sft: what the step computed and trained
            self.record["positions"].append(int(x.numel()))
            self.record["real_positions"].append(int(batch["attention_mask"].sum()))
            self.record["trained"].append(int((batch["labels"] != -100).sum()))
        self._start = time.perf_counter()
        self._forward.enter_context(self.breakdown.forward(pl_module))

    @override
    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Any) -> None:
        self._forward.close()

    @override
    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Any) -> None:
        self.breakdown.before_optimizer_step(pl_module)
        self._read_cuda_peak(pl_module)

    def _read_cuda_peak(self, pl_module: "pl.LightningModule") -> None:
        """The run's GPU peak: the largest reading at two points of every step, since lit_speed's DeviceStatsLogger
        resets CUDA's peak statistics at each logging interval (a single reading at the end sees the last interval's
        peak only)."""
        if pl_module.device.type == "cuda":
            self._cuda = pl_module.device  # Lightning's teardown moves the module to the CPU before on_fit_end
            self._cuda_peak = max(self._cuda_peak, torch.cuda.max_memory_allocated(pl_module.device))

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if pl_module.device.type == "cuda":  # the step's queued kernels done before the clock stops
            torch.cuda.synchronize(pl_module.device)
        self.record["step_s"].append(time.perf_counter() - self._start)
        self._read_cuda_peak(pl_module)
        self._forward.close()
        self.breakdown.after_optimizer_step(trainer.optimizers[0])
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.record["loss"].append(float(loss.detach()) if loss is not None else None)

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.record["memory_breakdown"] = self.breakdown.result()
        if self._cuda is not None:
            self.record["cuda_peak_bytes"] = max(self._cuda_peak, torch.cuda.max_memory_allocated(self._cuda))
        if trainer.is_global_zero:
            Path(self.out).write_text(json.dumps(self.record, indent=1))
