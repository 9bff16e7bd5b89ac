"""Low-bit AdamW (torchao 8-/4-bit states) vs torch's AdamW: what the first step costs, a steady step, and memory.

    python benchmarks/bench_lowbit_optim.py                       # 25M and 100M parameters, 10 timed steps each
    python benchmarks/bench_lowbit_optim.py --sizes 25 --repeats 3 --tag quick   # a brief run (a loaded machine)

The parameters are a decoder stack's shapes (per layer: q/k/v/o d x d, MLP d x 4d twice, two norms of d), without a
forward pass: the optimizer step alone is timed, on random gradients. Each variant runs in a fresh process (its own
RSS): ``first_step_s`` with an empty inductor cache (torchao compiles one kernel per parameter shape on the first
step; torch's AdamW compiles nothing), ``first_step_warm_cache_s`` in a second process on the same cache (what a
resumed or repeated run pays), then the median of ``--repeats`` steady steps after two warm-up steps. Memory: the
optimizer's declared state bytes (``lit_speed.state_bytes_per_param``), the bytes its state really holds after the
steps, and the process's peak RSS above its RSS before the optimizer was built.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import stats, write_result

VARIANTS = ("adamw", "adamw_foreach", "adamw_fused", "adamw8bit", "adamw4bit")
HIDDEN = {25: 512, 100: 1024}  # 8 layers of 12 d^2 (+ norms): 25.2M and 100.7M parameters


def _params(size: int):
    import torch

    d = HIDDEN[size]
    shapes = []
    for _ in range(8):
        shapes += [(d, d)] * 4 + [(4 * d, d), (d, 4 * d), (d,), (d,)]
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=generator) * 0.02) for s in shapes]


def _optimizer(variant: str, params):
    import torch

    if variant == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, foreach=False)
    if variant == "adamw_foreach":
        return torch.optim.AdamW(params, lr=1e-4, foreach=True)
    if variant == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-4, fused=True)
    from lit_speed.optim.low_bit import AdamW4bit, AdamW8bit

    return (AdamW8bit if variant == "adamw8bit" else AdamW4bit)(params, lr=1e-4)


def worker(variant: str, size: int, repeats: int) -> dict:
    """One variant in this process: first step, steady steps, state bytes, peak RSS above the start."""
    import torch

    from lit_speed import state_bytes_per_param

    params = _params(size)
    generator = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator) * 1e-3
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    optimizer = _optimizer(variant, params)
    t0 = time.perf_counter()
    optimizer.step()
    first = time.perf_counter() - t0
    for _ in range(2):
        optimizer.step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - t0)
    if variant.startswith("adamw") and "bit" in variant:
        from lit_speed.optim.low_bit import state_bytes_of

        held = state_bytes_of(optimizer.state)
    else:
        held = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                   if isinstance(t, torch.Tensor) and t.dim() > 0)
    n = sum(p.numel() for p in params)
    return {"variant": variant, "params": n, "first_step_s": first, "step_s": stats(times),
            "state_bytes_declared": state_bytes_per_param(optimizer) * n, "state_bytes_held": held,
            "peak_rss_above_start_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before,
            "threads": torch.get_num_threads()}


def _run(variant: str, size: int, repeats: int, cache: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, __file__, "--worker", variant, str(size), str(repeats)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="25,100", help="millions of parameters: 25 and/or 100")
    parser.add_argument("--repeats", type=int, default=10, help="timed steady steps per variant")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--tag", default="", help="suffix of the results file (e.g. quick)")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        variant, size, repeats = args.worker
        print(json.dumps(worker(variant, int(size), int(repeats))))
        return
    rows = []
    load = os.getloadavg()[0]
    for size in (int(s) for s in args.sizes.split(",")):
        for variant in args.variants.split(","):
            with tempfile.TemporaryDirectory(prefix="inductor_") as cache:  # empty: a cold first step
                cold = _run(variant, size, args.repeats, cache)
                warm = _run(variant, size, 1, cache)
            cold["first_step_warm_cache_s"] = warm["first_step_s"]
            rows.append({"size_m": size, **cold})
            print(f"{size}M {variant:14s} first {cold['first_step_s']:7.2f} s (warm cache "
                  f"{warm['first_step_s']:6.2f} s), step {cold['step_s']['median'] * 1e3:8.1f} ms, state "
                  f"{cold['state_bytes_held'] / 2**20:8.1f} MiB (declared {cold['state_bytes_declared'] / 2**20:8.1f}), "
                  f"RSS +{cold['peak_rss_above_start_bytes'] / 2**20:8.1f} MiB", flush=True)
    summary = []
    for size in sorted({r["size_m"] for r in rows}):
        by = {r["variant"]: r for r in rows if r["size_m"] == size}
        base = by.get("adamw_fused") or next(iter(by.values()))
        for name, r in by.items():
            summary.append(f"{size}M {name}: step x{r['step_s']['median'] / base['step_s']['median']:.2f} of fused "
                           f"({r['step_s']['median'] * 1e3:.0f} ms), first {r['first_step_s']:.1f} s cold / "
                           f"{r['first_step_warm_cache_s']:.1f} s warm, state x"
                           f"{r['state_bytes_held'] / base['state_bytes_held']:.3f}")
    name = "lowbit_optim" + (f"_{args.tag}" if args.tag else "")
    write_result(name, {"rows": rows, "repeats": args.repeats, "load_at_start": load,
                        "load_at_end": os.getloadavg()[0]},
                 f"optimizer step alone, {args.repeats} steady steps, load {load:.1f} -> {os.getloadavg()[0]:.1f}: "
                 + "; ".join(summary))


if __name__ == "__main__":
    main()
