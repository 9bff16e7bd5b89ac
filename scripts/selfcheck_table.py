"""Measure the cells of ``selfcheck.py --gpu --table`` on one CUDA device (imported by ``selfcheck.py``).

Each cell is a short in-process Lightning fit of the charlm GPT (12 layers, 12 heads, 768 embd, context 256,
~85M parameters) on random tokens (throughput and memory do not depend on the text): ``WARMUP`` steps, then
at least ``TIMED`` steps and ``MIN_SECONDS`` of them, timed with the device synchronised at both ends (a window of a
few steps lasts ~0.1 s on a big GPU, where Python's per-step cost and the clock ramping up from idle swing the
result by x2), and ``torch.cuda.max_memory_allocated`` over the timed steps (weights, gradients and optimizer
state included). The table, verdicts and files come from :mod:`lit_speed.reporting.gpu_table`. A cell that runs
out of memory is recorded as ``oom``; once the time budget is spent the remaining cells are recorded as skipped.
"""
from __future__ import annotations

import functools
import gc
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset

from lit_speed.reporting.gpu_table import Cell

GPT_SIZE = {"n_layer": 12, "n_head": 12, "n_embd": 768}
BLOCK = 256
VOCAB = 97  # lit_speed.data.charlm.VOCAB_SIZE
WARMUP, TIMED = 5, 10
MIN_SECONDS = 2.0  # the timed window's least length
MAX_STEPS = 100_000  # a bound the window's stop comes long before


class RandomTokens(Dataset):
    """``(x, y)`` pairs of random token windows, one micro-batch per item."""

    def __init__(self, batches: int, micro_batch: int, length: int | None = None) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, VOCAB, (batches, micro_batch, BLOCK + 1), generator=g)
        self.length = length or batches  # longer than ``batches``: the same batches again (the fit stops on time)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        i %= len(self.data)
        return self.data[i, :, :-1], self.data[i, :, 1:]


class TimedWindow(Callback):
    """Synchronised wall time and peak allocated memory over the batches after ``warmup``; stops the fit once the
    window holds ``min_steps`` steps and ``min_seconds`` (``sync`` waits for the device: CUDA's, or none)."""

    def __init__(self, warmup: int, min_steps: int = TIMED, min_seconds: float = MIN_SECONDS,
                 sync: Any = None) -> None:
        self.warmup, self.min_steps, self.min_seconds = warmup, min_steps, min_seconds
        self.sync = sync or (torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None))
        self.start: float | None = None
        self.seconds = 0.0
        self.steps = 0
        self.peak = 0

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        if batch_idx == self.warmup:
            self.sync()
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        steps = batch_idx + 1 - self.warmup
        if self.start is None or self.steps or steps < self.min_steps:
            return
        if time.perf_counter() - self.start >= self.min_seconds:  # unsynchronised look; the sync is the measure
            self.sync()
            self.seconds, self.steps = time.perf_counter() - self.start, steps
            trainer.should_stop = True

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.start is not None and not self.steps:  # the fit ended (max_steps) before the window was full
            self.sync()
            self.seconds, self.steps = time.perf_counter() - self.start, trainer.global_step - self.warmup
        self.peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def _strategy(cell: Cell) -> Any:
    if cell.zero_stage is None:
        return "auto"
    from lit_speed.strategies.zero_strategy import ZeroStrategy

    return ZeroStrategy(stage=cell.zero_stage, offload_optimizer=cell.offload,
                        offload_parameters=cell.offload and cell.zero_stage == 3)


def _optimizer(cell: Cell) -> Any:
    if cell.offload:  # offloaded optimizer state is stepped on the host: DeepSpeed's CPU Adam
        from lit_speed.optim.cpu_adam import CPUAdam

        return functools.partial(CPUAdam, lr=3e-4, adamw_mode=True)
    return functools.partial(torch.optim.AdamW, lr=3e-4, fused=True)


def measure_cell(cell: Cell) -> Cell:
    """Fill ``cell`` with tokens/s and peak allocated memory (or its ``oom`` / ``error: ...`` status)."""
    from lit_speed.memory.activation_checkpointing import ActivationCheckpointing
    from lit_speed.models.gpt import GPTModule

    torch.set_float32_matmul_precision("high" if cell.precision == "tf32" else "highest")
    precision = "32-true" if cell.precision == "tf32" else cell.precision
    window = TimedWindow(WARMUP)
    callbacks: list[Callback] = [window] + ([ActivationCheckpointing(["Block"])] if cell.checkpointing else [])
    trainer = model = None
    try:
        model = GPTModule(vocab_size=VOCAB, block_size=BLOCK, optimizer=_optimizer(cell), **GPT_SIZE)
        trainer = pl.Trainer(accelerator="cuda", devices=1, strategy=_strategy(cell), precision=precision,
                             max_steps=MAX_STEPS, callbacks=callbacks, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                             num_sanity_val_steps=0)
        trainer.fit(model, DataLoader(RandomTokens(16, cell.micro_batch, length=MAX_STEPS), batch_size=None))
        cell.tokens_per_sec = window.steps * cell.micro_batch * BLOCK / window.seconds
        cell.peak_allocated_bytes = int(window.peak)
        cell.status = "ok"
    except torch.cuda.OutOfMemoryError:
        cell.status = "oom"
    except Exception as error:  # noqa: BLE001 - one failing cell is a row of the table, not the end of it
        cell.status = f"error: {type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
    finally:
        del trainer, model
        gc.collect()
        torch.cuda.empty_cache()
        torch.set_float32_matmul_precision("highest")
    return cell


def measure_all(cells: list[Cell], deadline: float, log: Any = print) -> list[Cell]:
    """Measure ``cells`` in order until ``time.monotonic()`` passes ``deadline``; the rest are skipped."""
    for cell in cells:
        if time.monotonic() > deadline:
            cell.status = "skipped: time budget spent"
            continue
        started = time.monotonic()
        measure_cell(cell)
        log(f"{cell.label}: {cell.status}, {cell.tokens_per_sec or 0:,.0f} tokens/s "
            f"({time.monotonic() - started:.0f} s)")
    return cells


def machine() -> dict[str, Any]:
    """GPU, versions and commit for the report's header line."""
    import subprocess

    import deepspeed
    import lightning

    from lit_speed.reporting.gpu_table import GIB

    props = torch.cuda.get_device_properties(0)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"gpu": f"{props.name} ({props.total_memory / GIB:.0f} GiB)", "cuda": torch.version.cuda,
            "torch": torch.__version__, "lightning": lightning.__version__, "deepspeed": deepspeed.__version__,
            "commit": commit or "unknown", "model": f"GPT {GPT_SIZE['n_layer']}L/{GPT_SIZE['n_head']}H/"
            f"{GPT_SIZE['n_embd']}d, context {BLOCK}",
            "steps": f"{WARMUP} warm-up + >= {TIMED} timed and >= {MIN_SECONDS:g} s",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
