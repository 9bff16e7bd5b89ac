"""A Lightning callback that logs a few meaningful device numbers and ends the fit with a bottleneck verdict."""
from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lit_speed.memory.host_memory import host_memory
from lit_speed.monitoring.diagnosis import RunStats, diagnose, format_compute, verdict_rows
from lit_speed.monitoring.flops import (
    FlopCount,
    contains_compiled,
    device_peak_flops,
    low_precision_share,
    model_flops_utilization,
    step_peak_flops,
)
from lit_speed.monitoring.samplers import HostStats, NvmlSampler, batch_size_and_tokens, summarize_gpu_samples
from lit_speed.monitoring.step_timer import StepTimer, TimeSplit
from lit_speed.precision.modes import compute_dtype
from lit_speed.tables import print_table

log = logging.getLogger(__name__)

#: Every key the logger can write, with its unit. GPU keys appear only on CUDA, tokens only for token batches,
#: ``perf/mfu`` only when the peak is known. Memory keys are the max over ranks; the rest are rank zero's.
METRICS = {
    "time/batch_ms": "mean wall time per training batch, milliseconds",
    "time/data_wait_frac": "share of batch time between batches: fetching the next one, plus the loop's logging (0-1)",
    "time/forward_backward_frac": "share of batch time in zero_grad + forward + backward (0-1)",
    "time/optimizer_frac": "share of batch time in gradient clipping + optimizer.step + LR scheduler (0-1)",
    "throughput/samples_per_sec": "training samples per second",
    "throughput/tokens_per_sec": "training tokens per second (integer (B, T) batches only)",
    "perf/tflops_per_sec": "achieved model TFLOP/s (FLOPs counted on the first batch)",
    "perf/mfu": "achieved FLOP/s over the device peak (0-1)",
    "stats/cpu_rss_bytes": "resident memory of the process, bytes",
    "stats/cpu_rss_peak_bytes": "peak resident memory of the process so far, bytes",
    "stats/cpu_util_pct": "process CPU time over wall time since the last log, % (100 = one core)",
    "stats/sys_mem_available_bytes": "system memory available, bytes",
    "stats/gpu_util_pct": "mean NVML GPU utilisation over the interval, %",
    "stats/gpu_mem_used_bytes": "max NVML device memory used over the interval, bytes",
    "stats/gpu_mem_total_bytes": "device memory, bytes",
    "stats/gpu_power_w": "mean board power over the interval, watts",
    "stats/gpu_temp_c": "max GPU temperature over the interval, degrees Celsius",
    "stats/gpu_mem_peak_allocated_bytes": "torch.cuda peak allocated memory over the interval, bytes",
    "stats/gpu_mem_peak_reserved_bytes": "torch.cuda peak reserved memory over the interval, bytes",
}


def interval_metrics(split: TimeSplit, samples: int, tokens: int, flops_per_batch: float | None,
                     peak_flops: float | None) -> dict[str, float]:
    """Time split, throughput and MFU of one interval (empty when no batch finished in it)."""
    total = split.total_s
    if split.batches <= 0 or total <= 0:
        return {}
    fracs = split.fractions()
    metrics = {"time/batch_ms": 1000.0 * total / split.batches,
               "time/data_wait_frac": fracs["data_wait"], "time/forward_backward_frac": fracs["forward_backward"],
               "time/optimizer_frac": fracs["optimizer"], "throughput/samples_per_sec": samples / total}
    if tokens:
        metrics["throughput/tokens_per_sec"] = tokens / total
    if flops_per_batch:
        flops_per_sec = flops_per_batch * split.batches / total
        metrics["perf/tflops_per_sec"] = flops_per_sec / 1e12
        if peak_flops:
            metrics["perf/mfu"] = model_flops_utilization(flops_per_sec, peak_flops)
    return metrics


class DeviceStatsLogger(Callback):
    """Log memory, utilisation, throughput, the step-time split and MFU; end the fit with a bottleneck verdict.

    Every ``interval`` optimizer steps the keys of :data:`METRICS` go to every Lightning logger. The step
    time is split into data wait, forward+backward and optimizer step from host timestamps (CUDA events on
    GPU, read only at interval boundaries: no device sync per step). FLOPs per batch are counted once, on
    the first training batch, which is also left out of all timings as warm-up. At the end of training the
    verdict of :func:`~lit_speed.monitoring.diagnosis.diagnose` is printed as a table and written to
    ``<dirpath>/bottleneck.json``.

    Args:
        interval: Optimizer steps between logs; ``None`` follows ``Trainer(log_every_n_steps=...)``.
        measure_flops: Count FLOPs of the first batch (a module attribute ``flops_per_batch`` wins if present).
        peak_flops: Device peak FLOP/s for MFU; ``None`` = the peak of the step's FLOPs in the dtypes their matmuls
            ran in (:func:`~lit_speed.monitoring.flops.step_peak_flops`: datasheet table on GPU, a short matmul
            probe on CPU).
        gpu_sample_every_s: NVML polling period on GPU; ``None`` = no NVML (torch.cuda memory only).
        dirpath: Folder of ``bottleneck.json``; ``None`` = ``trainer.default_root_dir``.
        verbose: Print the verdict table at the end of training (rank zero).

    Raises:
        ValueError: If ``interval`` < 1, ``peak_flops`` <= 0 or ``gpu_sample_every_s`` <= 0.

    Example::

        trainer = Trainer(callbacks=[DeviceStatsLogger(interval=20)], logger=CSVLogger("logs"))
        trainer.fit(model)  # prints "verdict: input-bound: 46% of step time waiting for data" ...
    """

    def __init__(self, interval: int | None = None, measure_flops: bool = True, peak_flops: float | None = None,
                 gpu_sample_every_s: float | None = 0.5, dirpath: str | None = None, verbose: bool = True) -> None:
        if interval is not None and (not isinstance(interval, int) or interval < 1):
            raise ValueError(f"interval must be an int >= 1 optimizer steps (or None to follow "
                             f"Trainer.log_every_n_steps), got {interval!r}")
        if peak_flops is not None and peak_flops <= 0:
            raise ValueError(f"peak_flops must be > 0 FLOP/s (e.g. 1.2e11), or None to measure/look it up, "
                             f"got {peak_flops!r}")
        if gpu_sample_every_s is not None and gpu_sample_every_s <= 0:
            raise ValueError(f"gpu_sample_every_s must be > 0 seconds, or None to skip NVML, got {gpu_sample_every_s!r}")
        self.interval = interval
        self.measure_flops = measure_flops
        self.peak_flops = peak_flops
        self.gpu_sample_every_s = gpu_sample_every_s
        self.dirpath = dirpath
        self.verbose = verbose
        self.result: dict[str, Any] = {}
        self._reset_run()

    def _reset_run(self) -> None:
        # a checkpoint restore (after setup) brings back the run totals and the FLOP count
        self.flops_per_batch: float | None = None
        self.flops_by_dtype: dict[torch.dtype, float] = {}  # the counted batch's FLOPs by matmul dtype
        self._fallback_dtype = torch.float32  # the precision's compute dtype, for FLOPs that were not counted
        self._total = TimeSplit()
        self._total_samples = self._total_tokens = 0
        self._timer = StepTimer()
        self._flops = FlopCount()
        self._host: HostStats | None = None
        self._gpu: NvmlSampler | None = None
        self._peak: float | None = self.peak_flops
        self._peak_source = "peak_flops argument" if self.peak_flops else "unknown"
        self._peak_resolved = False
        self._warmup = True
        self._last_step = 0
        self._checkpointing: bool | None = None
        self._samples = self._tokens = 0
        self._min_available: float | None = None
        self._memory_peak = 0.0  # max over ranks
        self._own_memory_peak = 0.0
        self._gpu_util: list[float] = []

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        self._reset_run()
        device = trainer.strategy.root_device
        self._timer = StepTimer(cuda=device.type == "cuda")
        self._host = HostStats()
        if self.gpu_sample_every_s is not None:
            try:
                self._gpu = self.make_gpu_sampler(device, self.gpu_sample_every_s)
            except ModuleNotFoundError as error:
                rank_zero_warn(f"DeviceStatsLogger: no GPU utilisation, power or temperature. {error}")

    def make_gpu_sampler(self, device: torch.device, every_s: float) -> NvmlSampler | None:
        """The NVML sampler for the run's device: one on CUDA, none elsewhere. Override to sample another GPU.

        Raises:
            ModuleNotFoundError: If ``nvidia-ml-py`` is not installed (the fit goes on without GPU stats).
        """
        return NvmlSampler(device.index or 0, every_s) if device.type == "cuda" else None

    def _resolve_peak(self, trainer: "pl.Trainer") -> None:
        """The peak MFU divides by: the counted step's FLOP mix at each dtype's peak, else the precision's dtype."""
        if self._peak is not None or self._peak_resolved:
            return
        self._peak_resolved = True
        device = trainer.strategy.root_device
        mix = self.flops_by_dtype or {self._fallback_dtype: 1.0}
        self._peak, self._peak_source = step_peak_flops(mix, lambda dtype: device_peak_flops(device, dtype))

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        from lit_speed import activation_checkpointing_on

        self._last_step = trainer.global_step
        self._checkpointing = activation_checkpointing_on(pl_module)  # applied at setup, before this hook
        if self._gpu is not None:
            self._gpu.start()

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        if not self._warmup:
            self._timer.mark("batch_start")
            return
        # the dtype the step runs in where FLOPs are not counted: precision=auto (and threads=auto) decide on the
        # first batch, before this hook; the peak itself is resolved at the end of this batch, from the counted mix
        self._fallback_dtype = compute_dtype(getattr(trainer.precision_plugin, "precision", trainer.precision))
        if self.flops_per_batch is None and getattr(pl_module, "flops_per_batch", None):
            self.flops_per_batch = float(pl_module.flops_per_batch)
        if self.measure_flops and self.flops_per_batch is None and contains_compiled(pl_module):
            rank_zero_warn("DeviceStatsLogger: the model is torch.compile-d, and counting FLOPs under a dispatch mode "
                           "would keep dynamo from compiling it; set `flops_per_batch` on the LightningModule (e.g. "
                           "from an uncompiled run's bottleneck.json) to get perf/mfu")
        elif self.measure_flops and self.flops_per_batch is None:
            try:
                self._flops.start()
            except RuntimeError as error:  # e.g. a dispatch mode that refuses to nest
                rank_zero_warn(f"DeviceStatsLogger: FLOP counting failed ({error}); MFU will not be logged")

    def _stop_counting(self) -> None:
        self.flops_per_batch = float(self._flops.stop()) or None
        self.flops_by_dtype = {dtype: float(n) for dtype, n in self._flops.by_dtype.items()}
        if self._flops.error:
            rank_zero_warn(f"DeviceStatsLogger: FLOP counting failed ({self._flops.error}); perf/mfu will not be "
                           "logged. Fix: set `flops_per_batch` on the LightningModule, or measure_flops=False "
                           "(callbacks.device_stats.measure_flops=false)")

    @override
    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                                 optimizer: torch.optim.Optimizer) -> None:
        if self._flops.active:
            self._stop_counting()
        elif not self._warmup:
            self._timer.mark("before_optimizer")

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if self._flops.active:  # a batch that only accumulated gradients
            self._stop_counting()
        if self._warmup:
            self._resolve_peak(trainer)  # the probe runs here, in the untimed warm-up batch
            self._warmup = False
            self._timer.reset()
        else:
            samples, tokens = batch_size_and_tokens(batch)
            self._samples += samples
            self._tokens += tokens
        self._timer.mark("batch_end")
        step = trainer.global_step
        if step != self._last_step and step % self._interval(trainer) == 0:
            self._log_interval(trainer)
        self._last_step = step

    def _interval(self, trainer: "pl.Trainer") -> int:
        return self.interval or max(trainer.log_every_n_steps, 1)

    def _flush(self) -> tuple[TimeSplit, int, int]:
        split, samples, tokens = self._timer.flush(), self._samples, self._tokens
        self._total.add(split)
        self._total_samples += samples
        self._total_tokens += tokens
        self._samples = self._tokens = 0
        return split, samples, tokens

    def _read_devices(self, trainer: "pl.Trainer") -> dict[str, float]:
        metrics = self._host.read() if self._host is not None else {}
        available = metrics.get("stats/sys_mem_available_bytes")
        if available is not None:
            self._min_available = available if self._min_available is None else min(self._min_available, available)
        device = trainer.strategy.root_device
        if device.type == "cuda":
            metrics["stats/gpu_mem_peak_allocated_bytes"] = float(torch.cuda.max_memory_allocated(device))
            metrics["stats/gpu_mem_peak_reserved_bytes"] = float(torch.cuda.max_memory_reserved(device))
            torch.cuda.reset_peak_memory_stats(device)  # the next interval's peak starts here
        if self._gpu is not None:
            metrics.update(summarize_gpu_samples(self._gpu.drain()))
            if "stats/gpu_util_pct" in metrics:
                self._gpu_util.append(metrics["stats/gpu_util_pct"])
        key = "stats/gpu_mem_peak_reserved_bytes" if device.type == "cuda" else "stats/cpu_rss_peak_bytes"
        self._own_memory_peak = max(self._own_memory_peak, metrics.get(key, 0.0))
        memory_keys = [k for k in ("stats/cpu_rss_peak_bytes", "stats/gpu_mem_peak_reserved_bytes") if k in metrics]
        if trainer.world_size > 1 and memory_keys:
            # the rank that runs out first is the one that matters; a small collective once per interval
            peaks = torch.tensor([metrics[k] for k in memory_keys], dtype=torch.float64, device=device)
            peaks = trainer.strategy.reduce(peaks, reduce_op="max")
            metrics.update({k: float(v) for k, v in zip(memory_keys, peaks.tolist())})
        self._memory_peak = max(self._memory_peak, metrics.get(key, 0.0))
        return metrics

    def _log_interval(self, trainer: "pl.Trainer") -> None:
        split, samples, tokens = self._flush()
        metrics = interval_metrics(split, samples, tokens, self.flops_per_batch, self._peak)
        metrics.update(self._read_devices(trainer))
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._timer.pause()  # validation and the checkpoint it triggers are not data wait

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._flush()
        self._read_devices(trainer)
        device = trainer.strategy.root_device
        total = self._total.total_s
        flops_per_sec = self.flops_per_batch * self._total.batches / total if self.flops_per_batch and total else None
        if flops_per_sec and self._peak and flops_per_sec > self._peak and "MFU reads 100%" not in self._peak_source:
            self._peak_source += (f"; this run's {flops_per_sec / 1e9:.3g} GFLOP/s is above it (the probe measured "
                                  "low), so MFU reads 100%")
        if device.type == "cuda":
            capacity = float(torch.cuda.get_device_properties(device).total_memory)
        else:  # what the peak could have grown to: never more than the host memory this process may use
            total = float(host_memory().total)
            capacity = min(self._memory_peak + self._min_available, total) if self._min_available is not None \
                else total
        stats = RunStats(
            data_wait_s=self._total.data_wait_s, forward_backward_s=self._total.forward_backward_s,
            optimizer_s=self._total.optimizer_s, batches=self._total.batches, device=device.type,
            mfu=model_flops_utilization(flops_per_sec, self._peak), flops_per_sec=flops_per_sec,
            gpu_util_pct=sum(self._gpu_util) / len(self._gpu_util) if self._gpu_util else None,
            memory_peak_bytes=self._memory_peak or None, memory_capacity_bytes=capacity,
            samples_per_sec=self._total_samples / total if total else None,
            tokens_per_sec=self._total_tokens / total if total and self._total_tokens else None,
            activation_checkpointing=self._checkpointing, low_precision_frac=low_precision_share(self.flops_by_dtype))
        self.result = diagnose(stats)
        per_rank = [self._own_memory_peak]
        if trainer.world_size > 1:
            own = torch.tensor([self._own_memory_peak], dtype=torch.float64, device=device)
            per_rank = trainer.strategy.all_gather(own).flatten().tolist()
        self.result.update({"flops_per_batch": self.flops_per_batch, "flops_by_dtype": _by_name(self.flops_by_dtype),
                            "peak_flops": self._peak,
                            "peak_flops_source": self._peak_source, "world_size": trainer.world_size,
                            "per_rank_memory_peak_bytes": per_rank})
        self._stop_sampler()
        if trainer.is_global_zero and not trainer.fast_dev_run:
            out = Path(self.dirpath or trainer.default_root_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / "bottleneck.json").write_text(json.dumps(self.result, indent=1))
            if self.verbose:
                print_table("lit_speed bottleneck", {**verdict_rows(self.result), "written": str(out / "bottleneck.json")})

    def _stop_sampler(self) -> None:
        if self._gpu is not None:
            self._gpu.stop()

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        if self._flops.active:
            self._flops.stop()
        self._stop_sampler()

    def describe(self) -> dict[str, str]:
        """Row for the start-up table."""
        every = f"every {self.interval} optimizer steps" if self.interval else "every log_every_n_steps"
        peak = f"peak {self.peak_flops:.3g} FLOP/s" if self.peak_flops else "peak measured/looked up"
        return {"device stats": f"{every}: time split, throughput, memory, MFU ({peak}); verdict -> bottleneck.json"}

    def end_rows(self) -> dict[str, str]:
        """Rows for the runner's end-of-run table: achieved FLOP/s and MFU (``lit_speed.run_contract.EndOfRunReport``)."""
        evidence = self.result.get("evidence", {})
        if not evidence.get("flops_per_sec"):
            why = "FLOPs not counted" if self.flops_per_batch is None else "no timed batch"
            return {"compute (MFU)": f"n/a ({why}; see bottleneck.json)"} if self.result else {}
        peak = self.result.get("peak_flops_source", "")
        return {"compute (MFU)": format_compute(evidence["flops_per_sec"], evidence.get("mfu"))
                + (f" (peak: {peak})" if peak else "")}

    def final_summary(self) -> dict[str, Any]:
        """The verdict (``bottleneck.json``'s content) for the run summary."""
        return dict(self.result)

    @override
    def state_dict(self) -> dict[str, Any]:
        # the verdict covers the whole run, so its time split and counts survive a resume
        return {"total": asdict(self._total), "samples": self._total_samples, "tokens": self._total_tokens,
                "flops_per_batch": self.flops_per_batch, "flops_by_dtype": _by_name(self.flops_by_dtype)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._total = TimeSplit(**state_dict.get("total", {}))
        self._total_samples = state_dict.get("samples", 0)
        self._total_tokens = state_dict.get("tokens", 0)
        self.flops_per_batch = state_dict.get("flops_per_batch", self.flops_per_batch)
        by_name = state_dict.get("flops_by_dtype") or {}
        self.flops_by_dtype = {getattr(torch, name): float(n) for name, n in by_name.items()
                               if isinstance(getattr(torch, name, None), torch.dtype)} or self.flops_by_dtype


def _by_name(flops_by_dtype: dict[torch.dtype, float]) -> dict[str, float]:
    """``{"bfloat16": n, ...}``: the FLOP mix in JSON and in checkpoints."""
    return {str(dtype).removeprefix("torch."): n for dtype, n in flops_by_dtype.items()}
