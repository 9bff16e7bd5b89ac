"""Shared benchmark plumbing: timing with warm-up and repeats, machine/version capture, JSON + LOG.md.

Every benchmark script: warm up, time only what it claims, repeat, report median and spread,
compare variants as ratios measured in the same run, then call :func:`write_result`.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
LOG = ROOT / "benchmarks" / "LOG.md"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("LIT_SPEED_ROOT", str(ROOT))
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def machine() -> dict[str, Any]:
    """CPU model, cores, memory, GPU (if any) and whether the CPU has native bf16 kernels."""
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "cores": os.cpu_count()}
    from lit_speed.tuning.machine_cache import cpuinfo

    fields = cpuinfo()
    try:
        info["cpu"] = fields["model name"]
        # family/model/stepping tell CPU generations apart where the model name does not ("AMD EPYC" on Zen3-5)
        info["cpu_id"] = {k.replace("cpu ", ""): fields.get(k) for k in ("vendor_id", "cpu family", "model", "stepping")}
        flags = fields.get("flags", "").split()
        info["cpu_bf16_flags"] = sorted({f for f in flags if "bf16" in f or f.startswith("amx")})
        # the flags that decide kernel speed here: vector width, bf16/fp16/int8 dot products, matrix units
        info["cpu_flags"] = sorted({f for f in flags if f.startswith(("avx", "amx", "fma", "f16c", "sse4"))
                                    or "bf16" in f or "vnni" in f})
    except KeyError:  # not Linux: the processor string is what there is
        info["cpu"] = platform.processor()
    try:
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    try:
        import torch

        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        info["torch_threads"] = torch.get_num_threads()
        from lit_speed.compat.torch import cpu_has_native_bf16

        info["mkldnn_bf16"] = cpu_has_native_bf16()
    except Exception as error:  # noqa: BLE001 - a machine description must never stop a benchmark
        info["torch_error"] = repr(error)
    return info


def versions() -> dict[str, str]:
    out = {}
    for pkg in ("torch", "lightning", "deepspeed", "hydra-core", "torchmetrics", "numpy", "lit_speed"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def settle_disk() -> float:
    """``sync`` before a row starts; returns its seconds. A row's export writes a float32 model (2 GB at 0.5B); left
    to the page cache, its writeback slowed the next row's own writes: the same 2 GB save_pretrained took 0.5-5.1 s in
    one process on XA, and each row's export is in its launch-to-end time."""
    start = time.perf_counter()
    os.sync()
    return round(time.perf_counter() - start, 3)


def stats(samples: list[float]) -> dict[str, float]:
    """Median, spread (min/max, stdev) of repeated measurements."""
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples),
            "stdev": statistics.stdev(samples) if len(samples) > 1 else 0.0, "n": len(samples)}


def time_repeats(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1, sync: Callable[[], None] | None = None) -> dict[str, float]:
    """Run ``fn`` ``warmup`` times untimed, then ``repeats`` times timed (seconds)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if sync:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return stats(times)


def write_result(name: str, results: dict[str, Any], log_line: str) -> Path:
    """Write ``benchmarks/results/<name>.json`` and append a dated line to ``benchmarks/LOG.md``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": name, "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
              "commit": commit(), "versions": versions(), "machine": machine(), "results": results}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(record, indent=1, default=str))
    if not LOG.exists():
        LOG.write_text("# Benchmark log\n\nOne dated line per run: what was measured, on what, and the ratios found "
                       "(negative results included). JSON in `benchmarks/results/`.\n\n")
    cpu = record["machine"].get("cpu", "?")
    with LOG.open("a") as f:
        f.write(f"- {record['date'][:10]} `{name}` @ {record['commit']} on {cpu} ({record['machine']['cores']} cores): "
                f"{log_line}\n")
    print(f"wrote {path.relative_to(ROOT)} and a line in benchmarks/LOG.md")
    return path
