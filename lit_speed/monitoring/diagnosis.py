"""The bottleneck verdict: a pure function of the numbers the device-stats logger collected.

:func:`diagnose` reads where step time went (data wait, forward+backward, optimizer step), how busy the
device was (MFU, GPU utilisation) and how much memory was left, and names the one thing to fix first,
with its evidence and a concrete next step. It knows nothing about Lightning, so it is tested on
plain numbers and can be fed from any training loop.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# A fifth of every step spent idle waiting for the next batch is the largest, cheapest win in most
# runs (workers or preloading cost no accuracy), so it outranks everything else above this share.
INPUT_BOUND_FRAC = 0.20
# AdamW reads and writes ~4 tensors per parameter; when that rivals the model's own compute, a fused
# kernel or fewer steps (accumulation) is worth more than any change to the forward pass.
OPTIMIZER_BOUND_FRAC = 0.25
# A GPU that is busy less than this share of the time, while the loop is not waiting for data,
# is starved by the Python side launching small kernels.
GPU_BUSY_PCT = 60.0
# Below this MFU the matmuls are too small or too fragmented to use the hardware well.
LOW_MFU = 0.30
# Memory shares: above GROW the micro-batch can grow; below TIGHT the next allocation spike may OOM.
HEADROOM_GROW_FRAC = 0.50
HEADROOM_TIGHT_FRAC = 0.10


@dataclass(frozen=True)
class RunStats:
    """What a run measured. Every field except the time split may be unknown (None).

    Args:
        data_wait_s: Seconds the loop waited for batches.
        forward_backward_s: Seconds in forward + backward (and zero_grad).
        optimizer_s: Seconds in the optimizer step (and LR scheduler, gradient clipping).
        batches: Timed batches.
        device: ``"cpu"`` or ``"cuda"`` (changes the advice, not the verdict thresholds).
        mfu: Achieved model FLOP/s over the device peak, in [0, 1+].
        flops_per_sec: Achieved FLOP/s.
        gpu_util_pct: Mean NVML GPU utilisation.
        memory_peak_bytes: Peak memory of this process on its device (GPU reserved, or host RSS).
        memory_capacity_bytes: What that peak could have grown to (GPU total, or the smaller of peak RSS +
            available RAM and the host memory this process may use: ``lit_speed.memory.host_memory``).
        samples_per_sec: Training samples per second.
        tokens_per_sec: Training tokens per second (None when batches are not token arrays).
        activation_checkpointing: Whether the run recomputes activations (None: unknown); the memory advice
            suggests turning it off only when it is on, and on only when it is off.
        low_precision_frac: Share of the counted FLOPs whose matmuls ran in bf16 or fp16 (None: unknown); the
            compute advice does not suggest cheaper arithmetic to a run whose FLOPs mostly use it already.
    """

    data_wait_s: float
    forward_backward_s: float
    optimizer_s: float
    batches: int
    device: str = "cpu"
    mfu: float | None = None
    flops_per_sec: float | None = None
    gpu_util_pct: float | None = None
    memory_peak_bytes: float | None = None
    memory_capacity_bytes: float | None = None
    samples_per_sec: float | None = None
    tokens_per_sec: float | None = None
    activation_checkpointing: bool | None = None
    low_precision_frac: float | None = None


#: At or above this share of FLOPs in bf16/fp16, a run already uses cheaper arithmetic.
MOSTLY_LOW_PRECISION = 0.5


def _pct(frac: float) -> str:
    return f"{100 * frac:.0f}%"


def _gib(value: float) -> str:
    return f"{value / 2**30:.2f} GiB"


def _time_findings(stats: RunStats, fracs: dict[str, float]) -> list[dict[str, Any]]:
    found = []
    if fracs["data_wait"] >= INPUT_BOUND_FRAC:
        found.append({"kind": "input-bound", "score": fracs["data_wait"],
                      "message": f"input-bound: {_pct(fracs['data_wait'])} of step time waiting for data",
                      "next_step": "raise data.num_workers (DataLoader worker processes) or preload the data set "
                                   "into memory as tensors; look for per-sample file reads or decoding in __getitem__"})
    if fracs["optimizer"] >= OPTIMIZER_BOUND_FRAC:
        if stats.device == "cuda":
            advice = ("use a fused optimizer (optimizer=adamw_fused), shard optimizer state with ZeRO "
                      "(strategy=zero2), or offload it with CPU Adam (strategy=zero2_offload) when memory is the "
                      "limit; gradient accumulation (accumulation=fixed) runs the step less often")
        else:
            advice = ("use a fused optimizer (optimizer=adamw_fused: 4-5x faster steps than foreach AdamW on CPU "
                      "at 25M parameters), or accumulate gradients (accumulation=fixed) so the step runs less often")
        found.append({"kind": "optimizer-bound", "score": fracs["optimizer"],
                      "message": f"optimizer-bound: {_pct(fracs['optimizer'])} of step time in optimizer.step",
                      "next_step": advice})
    return sorted(found, key=lambda f: f["score"], reverse=True)


def _device_finding(stats: RunStats, fracs: dict[str, float]) -> dict[str, Any]:
    if stats.device == "cuda" and stats.gpu_util_pct is not None and stats.gpu_util_pct < GPU_BUSY_PCT:
        return {"kind": "host-bound", "score": fracs["forward_backward"],
                "message": f"host-bound: the GPU was busy {stats.gpu_util_pct:.0f}% of the time although only "
                           f"{_pct(fracs['data_wait'])} of step time went to waiting for data",
                "next_step": "launch fewer, larger kernels: grow the micro-batch (data.batch_size) or compile the "
                             "model (torch.compile) to cut per-operator Python and launch overhead"}
    mfu = f" at {_pct(stats.mfu) if stats.mfu >= 0.01 else f'{100 * stats.mfu:.2g}%'} MFU" \
        if stats.mfu is not None else ""
    if stats.mfu is not None and stats.mfu < LOW_MFU:
        advice = ("the matmuls run well below the device peak: a larger micro-batch (data.batch_size) makes them "
                  "bigger, and torch.compile fuses the small element-wise operators between them")
    elif stats.low_precision_frac is not None and stats.low_precision_frac >= MOSTLY_LOW_PRECISION:
        advice = (f"the arithmetic units are busy and {_pct(stats.low_precision_frac)} of the FLOPs already run in "
                  "bf16/fp16: speed now comes from fewer FLOPs per unit of quality (a smaller model, fewer trainable "
                  "layers, a curriculum, fewer steps) or from more devices")
    else:
        advice = ("the arithmetic units are busy: speed now comes from cheaper arithmetic (bf16-mixed, only where "
                  "the device has bf16 matmul units) or from fewer FLOPs per unit of quality (a smaller model, "
                  "a curriculum, fewer steps)")
    return {"kind": "compute-bound", "score": fracs["forward_backward"],
            "message": f"compute-bound: {_pct(fracs['forward_backward'])} of step time in forward+backward{mfu}",
            "next_step": advice}


def _memory_finding(stats: RunStats) -> dict[str, Any] | None:
    if not stats.memory_peak_bytes or not stats.memory_capacity_bytes:
        return None
    where = "GPU" if stats.device == "cuda" else "host"
    headroom = max(0.0, 1.0 - stats.memory_peak_bytes / stats.memory_capacity_bytes)
    evidence = f"{_gib(stats.memory_peak_bytes)} peak of {_gib(stats.memory_capacity_bytes)} {where} memory"
    if headroom >= HEADROOM_GROW_FRAC:  # advice only about what is on: turning off what is off helps nobody
        off = (", or turn off activation checkpointing (it is on: it recomputes activations in backward)"
               if stats.activation_checkpointing else "")
        return {"kind": "memory-headroom", "score": headroom,
                "message": f"memory headroom {_pct(headroom)} ({evidence}) - micro-batch can grow",
                "next_step": f"grow data.batch_size (scale the LR with it){off}"}
    if headroom < HEADROOM_TIGHT_FRAC:
        on = "" if stats.activation_checkpointing else "activation checkpointing, "
        return {"kind": "memory-tight", "score": 1.0 - headroom,
                "message": f"memory-tight: {_pct(headroom)} headroom ({evidence})",
                "next_step": f"{on}ZeRO-3 or offload, or a smaller micro-batch with gradient accumulation keeping "
                             "the effective batch"}
    return {"kind": "memory-ok", "score": headroom,
            "message": f"memory headroom {_pct(headroom)} ({evidence})", "next_step": ""}


def diagnose(stats: RunStats) -> dict[str, Any]:
    """Name the bottleneck of a run, with evidence and the next step.

    The verdict is the largest of: input-bound (data wait >= ``INPUT_BOUND_FRAC``) and optimizer-bound
    (optimizer >= ``OPTIMIZER_BOUND_FRAC``); else host-bound (GPU busy < ``GPU_BUSY_PCT``); else
    compute-bound. Memory headroom is reported alongside as a finding, never as the verdict.

    Args:
        stats: The measured numbers.

    Returns:
        ``{"verdict", "summary", "next_step", "evidence", "findings"}``: ``verdict`` is one of
        ``"input-bound"``, ``"optimizer-bound"``, ``"host-bound"``, ``"compute-bound"`` or ``"unknown"``
        (nothing was timed); ``findings`` lists every triggered finding, the verdict's first.

    Example::

        diagnose(RunStats(data_wait_s=4.6, forward_backward_s=4.0, optimizer_s=1.4, batches=100))["summary"]
        # 'input-bound: 46% of step time waiting for data'
    """
    total = stats.data_wait_s + stats.forward_backward_s + stats.optimizer_s
    evidence = {k: v for k, v in asdict(stats).items() if v is not None}
    if stats.batches <= 0 or total <= 0:
        return {"verdict": "unknown", "summary": "unknown: no training batch was timed",
                "next_step": "train for more than one batch", "evidence": evidence, "findings": []}
    fracs = {"data_wait": stats.data_wait_s / total, "forward_backward": stats.forward_backward_s / total,
             "optimizer": stats.optimizer_s / total}
    evidence.update({f"{k}_frac": round(v, 4) for k, v in fracs.items()})
    evidence["step_time_ms"] = round(1000 * total / stats.batches, 3)
    findings = _time_findings(stats, fracs) or [_device_finding(stats, fracs)]
    memory = _memory_finding(stats)
    if memory is not None:
        findings.append(memory)
    if memory is not None and stats.memory_capacity_bytes:
        evidence["memory_headroom_frac"] = round(1.0 - stats.memory_peak_bytes / stats.memory_capacity_bytes, 4)
    primary = findings[0]
    return {"verdict": primary["kind"], "summary": primary["message"], "next_step": primary["next_step"],
            "evidence": evidence, "findings": [{k: v for k, v in f.items() if k != "score"} for f in findings]}


def format_compute(flops_per_sec: float, mfu: float | None) -> str:
    """``"0.0250 TFLOP/s, MFU 25.0%"``; a small model's rate in GFLOP/s and its MFU with two significant digits
    (``"1.70 GFLOP/s, MFU 0.0022%"``), so a non-zero MFU never reads 0.0%."""
    rate = f"{flops_per_sec / 1e12:.4f} TFLOP/s" if flops_per_sec >= 1e9 else f"{flops_per_sec / 1e9:.3g} GFLOP/s"
    if mfu is None:
        return rate
    return f"{rate}, MFU {100 * mfu:.1f}%" if mfu >= 1e-3 else f"{rate}, MFU {100 * mfu:.2g}%"


def verdict_rows(result: dict[str, Any]) -> dict[str, str]:
    """Rows of the end-of-fit table: verdict, time split, MFU, then each other finding and its next step."""
    ev = result["evidence"]
    rows = {"verdict": result["summary"]}
    if "data_wait_frac" in ev:
        rows["time split"] = (f"data wait {_pct(ev['data_wait_frac'])} | forward+backward "
                              f"{_pct(ev['forward_backward_frac'])} | optimizer {_pct(ev['optimizer_frac'])} "
                              f"({ev['batches']} batches, {ev['step_time_ms']:.1f} ms each)")
    if ev.get("flops_per_sec"):
        rows["compute"] = format_compute(ev["flops_per_sec"], ev.get("mfu"))
    if result["next_step"]:
        rows["next step"] = result["next_step"]
    for finding in result["findings"][1:]:
        rows[finding["kind"]] = finding["message"] + (f"; {finding['next_step']}" if finding["next_step"] else "")
    return rows
