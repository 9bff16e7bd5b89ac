"""Activation checkpointing / offload memory and step time, and torch.compile speed-up, on the charlm GPT.

    python benchmarks/bench_memory.py [--repeats 7] [--micro-batches 12,48] [--skip-compile]

Memory, two ways: (1) activation peak = most tensor bytes alive during forward+backward beyond the parameters
(LiveTensorTracker, exact and noise-free); (2) process peak RSS growth over two training steps, each variant in a
fresh process (ru_maxrss after minus RSS before the model is built), with glibc's default malloc and with a fixed
``MALLOC_MMAP_THRESHOLD_`` (default glibc keeps freed activation blocks resident, so RSS hides the saving). Step time = forward+backward+AdamW step, variants interleaved
round-robin so machine noise hits them alike; median and spread over repeats after warm-up.
Compile: cold compile time (first step, empty inductor cache, fresh process) and steady step time, regional vs
whole-model vs eager.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from _common import RESULTS, ROOT, stats, write_result  # noqa: E402

from lit_speed.memory.activation_checkpointing import checkpoint_modules  # noqa: E402
from lit_speed.memory.compile_model import compile_modules  # noqa: E402
from lit_speed.memory.memory_tracker import LiveTensorTracker  # noqa: E402
from lit_speed.models.gpt import GPT  # noqa: E402

GPT_CFG = {"vocab_size": 97, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128}  # experiment=charlm_cpu
VARIANTS = {"plain": None, "checkpointing": False, "checkpointing+offload": True}


def build(variant: str, seed: int = 0) -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = GPT(**GPT_CFG)
    if VARIANTS.get(variant) is not None:
        checkpoint_modules(model, ["Block"], offload=VARIANTS[variant])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)


def step(model: GPT, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    logits = model(x)
    torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), x.view(-1)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def activation_peak(variant: str, micro: int) -> int:
    model, _ = build(variant)
    x = torch.randint(0, 97, (micro, 64))
    with LiveTensorTracker() as tracker:
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), x.view(-1)).backward()
    return tracker.peak_bytes


def child_rss(variant: str, micro: int) -> dict:
    """Run in a fresh process: peak RSS over two training steps minus RSS after imports (MEASUREMENTS.md method).

    Includes parameters, gradients and optimizer state (~13 MB here) and allocator slack, so it moves less than
    the activation peak does.
    """
    import psutil

    x = torch.randint(0, 97, (micro, 64))
    before = psutil.Process().memory_info().rss
    model, opt = build(variant)
    step(model, opt, x)
    step(model, opt, x)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"rss_growth_bytes": max(peak - before, 0)}


def child_compile(mode: str, micro: int, repeats: int) -> dict:
    """Run in a fresh process with an empty inductor cache: first-step (compile) time, then steady steps."""
    model, opt = build("plain")
    if mode != "eager":
        compile_modules(model, regional=mode == "regional")
    x = torch.randint(0, 97, (micro, 64))
    t0 = time.perf_counter()
    step(model, opt, x)
    first = time.perf_counter() - t0
    step(model, opt, x)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step(model, opt, x)
        times.append(time.perf_counter() - t0)
    return {"first_step_s": first, "step_s": stats(times)}


def run_child(args: list[str], env: dict | None = None) -> dict:
    threads = ["--threads", str(torch.get_num_threads())]
    out = subprocess.run([sys.executable, __file__, *threads, "--child", *args], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, **(env or {})}, timeout=900)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--micro-batches", default="12,48")
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    # 1 thread: on a shared 2-core machine, 2 OpenMP threads spin against other jobs and run ~10x slower
    torch.set_num_threads(args.threads)
    if args.child:
        kind, *rest = args.child
        result = child_rss(rest[0], int(rest[1])) if kind == "rss" else child_compile(rest[0], int(rest[1]), int(rest[2]))
        print(json.dumps(result))
        return

    results: dict = {"model": GPT_CFG, "threads": torch.get_num_threads(), "memory": {}, "compile": {}}
    for micro in [int(m) for m in args.micro_batches.split(",")]:
        x = torch.randint(0, 97, (micro, 64))
        built = {v: build(v) for v in VARIANTS}
        for v in VARIANTS:  # warm-up
            step(*built[v], x)
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for _ in range(args.repeats):  # round-robin
            for v in VARIANTS:
                t0 = time.perf_counter()
                step(*built[v], x)
                times[v].append(time.perf_counter() - t0)
        row = {}
        for v in VARIANTS:
            # glibc's dynamic mmap threshold keeps freed activation blocks resident, hiding what checkpointing
            # saves; a fixed threshold returns large blocks to the OS on free, so RSS follows live tensors
            fixed = run_child(["rss", v, str(micro)], {"MALLOC_MMAP_THRESHOLD_": "65536"})["rss_growth_bytes"]
            row[v] = {"activation_peak_bytes": activation_peak(v, micro), "step_s": stats(times[v]),
                      **run_child(["rss", v, str(micro)]), "rss_growth_fixed_mmap_threshold_bytes": fixed}
        base = row["plain"]
        for v in VARIANTS:
            row[v]["activation_ratio"] = row[v]["activation_peak_bytes"] / base["activation_peak_bytes"]
            row[v]["step_time_ratio"] = row[v]["step_s"]["median"] / base["step_s"]["median"]
        results["memory"][micro] = row
        print(f"micro-batch {micro}: " + ", ".join(
            f"{v}: act {r['activation_peak_bytes'] / 2**20:.1f} MiB (x{r['activation_ratio']:.2f}), "
            f"RSS +{r['rss_growth_bytes'] / 2**20:.0f} MiB "
            f"(+{r['rss_growth_fixed_mmap_threshold_bytes'] / 2**20:.0f} MiB fixed mmap threshold), step {r['step_s']['median'] * 1e3:.1f} ms "
            f"(x{r['step_time_ratio']:.2f})" for v, r in row.items()), flush=True)

    if not args.skip_compile:
        micro = 12
        for mode in ("eager", "regional", "whole"):
            with tempfile.TemporaryDirectory() as cache:  # cold: an empty inductor cache
                results["compile"][mode] = run_child(["compile", mode, str(micro), str(args.repeats)],
                                                     {"TORCHINDUCTOR_CACHE_DIR": cache})
            print(f"compile {mode}: first step {results['compile'][mode]['first_step_s']:.1f} s, steady "
                  f"{results['compile'][mode]['step_s']['median'] * 1e3:.1f} ms", flush=True)
        eager = results["compile"]["eager"]["step_s"]["median"]
        for mode in ("regional", "whole"):
            results["compile"][mode]["speedup_vs_eager"] = eager / results["compile"][mode]["step_s"]["median"]

    previous = RESULTS / "bench_memory.json"
    if args.skip_compile and previous.exists():  # keep the last compile numbers, labelled with their run
        old = json.loads(previous.read_text())
        compile_old = old["results"].get("compile") or old["results"].get("compile_previous_run", {}).get("compile")
        if compile_old:
            results["compile_previous_run"] = {"date": old["date"], "commit": old["commit"], "compile": compile_old}
    mem = results["memory"]
    parts = []
    for micro, row in mem.items():
        c = row["checkpointing"]
        rss = c["rss_growth_fixed_mmap_threshold_bytes"] / max(row["plain"]["rss_growth_fixed_mmap_threshold_bytes"], 1)
        parts.append(f"mb{micro}: checkpointing activation x{c['activation_ratio']:.2f} "
                     f"(RSS x{c['rss_growth_bytes'] / max(row['plain']['rss_growth_bytes'], 1):.2f} default glibc, "
                     f"x{rss:.2f} with MALLOC_MMAP_THRESHOLD_=65536) "
                     f"(-{(1 - c['activation_ratio']) * 100:.0f}%), step x{c['step_time_ratio']:.2f}; "
                     f"+offload step x{row['checkpointing+offload']['step_time_ratio']:.2f}")
    if results["compile"]:
        cmp = results["compile"]
        parts.append(f"compile regional x{cmp['regional']['speedup_vs_eager']:.2f} "
                     f"(cold {cmp['regional']['first_step_s']:.0f} s), whole x{cmp['whole']['speedup_vs_eager']:.2f} "
                     f"(cold {cmp['whole']['first_step_s']:.0f} s)")
    write_result("bench_memory", results, "charlm GPT 4L/128: " + "; ".join(parts)
                 + " (machine shared with other jobs: step-time ratios noisy)")


if __name__ == "__main__":
    main()
