"""ZeRO on CPU: optimizer-step time of DeepSpeedCPUAdam vs torch AdamW, and end-to-end charlm cost per strategy.

    python benchmarks/bench_zero.py                 # both parts (~10 min on 2 busy cores)
    python benchmarks/bench_zero.py --part optim --sizes 25
    python benchmarks/bench_zero.py --part e2e --steps 40

Part ``optim``: one optimizer step over ~25M and ~100M fp32 parameters (1024x1024 matrices with gradients),
AdamW default (for-loop on CPU), foreach, fused, and DeepSpeedCPUAdam (AdamW mode); median of repeats after
warm-up, ratios against the default. DeepSpeed claims CPU Adam is 5-7x faster than PyTorch's Adam.

Part ``e2e``: the charlm_cpu workload (4L/4H/128 GPT, block 64, batch 12), one fresh process per strategy
(strategy=auto, zero2, zero2_offload, zero3_offload; offload uses DeepSpeedCPUAdam): median training-step time
after warm-up, and peak RSS (ru_maxrss) minus RSS before fit, so imports are not counted.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, stats, time_repeats, write_result  # noqa: E402

E2E_VARIANTS = {  # name -> (strategy kwargs or None for Lightning's default, optimizer)
    "auto": (None, "adamw"),
    "zero2": ({"stage": 2}, "adamw"),
    "zero2_offload": ({"stage": 2, "offload_optimizer": True}, "cpu_adam"),
    "zero3_offload": ({"stage": 3, "offload_optimizer": True, "offload_parameters": True}, "cpu_adam"),
}


def bench_optimizers(million: int, repeats: int) -> dict[str, dict[str, float]]:
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    torch.manual_seed(0)
    n_mats = max(1, round(million * 1e6 / 2**20))
    params = [torch.nn.Parameter(torch.randn(1024, 1024) * 0.02) for _ in range(n_mats)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    makers = {
        "adamw_default": lambda: torch.optim.AdamW(params, lr=1e-3),
        "adamw_foreach": lambda: torch.optim.AdamW(params, lr=1e-3, foreach=True),
        "adamw_fused": lambda: torch.optim.AdamW(params, lr=1e-3, fused=True),
        "deepspeed_cpu_adam": lambda: DeepSpeedCPUAdam(params, lr=1e-3, adamw_mode=True),
    }
    out = {}
    for name, make in makers.items():
        opt = make()
        out[name] = time_repeats(opt.step, repeats=repeats, warmup=2)
        out[name]["params"] = n_mats * 2**20
        del opt
    return out


def e2e_worker(variant: str, steps: int, cache: str) -> dict[str, float]:
    """One strategy in this process: step times and peak RSS growth during fit."""
    import lightning.pytorch as pl
    import torch

    from lit_speed.data.charlm import CharLMDataModule
    from lit_speed.models.gpt import GPTModule
    from lit_speed.strategies.zero_strategy import ZeroStrategy

    strategy_kwargs, optimizer = E2E_VARIANTS[variant]
    if optimizer == "cpu_adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        factory = functools.partial(DeepSpeedCPUAdam, lr=3e-3, betas=(0.9, 0.99), adamw_mode=True)
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))])  # JIT build/load outside the timed run
    else:
        factory = functools.partial(torch.optim.AdamW, lr=3e-3, betas=(0.9, 0.99), foreach=True)
    pl.seed_everything(0, verbose=False)
    dm = CharLMDataModule(cache_dir=cache, block_size=64, batch_size=12)
    model = GPTModule(block_size=64, n_layer=4, n_head=4, n_embd=128, optimizer=factory)

    class StepTimer(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, *args) -> None:
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, *args) -> None:
            self.times.append(time.perf_counter() - self.t0)

    timer = StepTimer()
    strategy = ZeroStrategy(**strategy_kwargs) if strategy_kwargs else "auto"
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0, callbacks=[timer])
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    trainer.fit(model, dm)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    warm = timer.times[5:]  # the first steps include allocation and DeepSpeed's first-step set-up
    return {**stats(warm), "peak_rss_bytes": peak, "rss_before_fit_bytes": rss_before,
            "fit_rss_growth_bytes": peak - rss_before}


def bench_e2e(steps: int) -> dict[str, dict[str, float]]:
    cache = str(ROOT / ".cache" / "charlm")
    out = {}
    for variant in E2E_VARIANTS:
        cmd = [sys.executable, __file__, "--worker", variant, "--steps", str(steps), "--cache", cache]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        lines = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            out[variant] = {"error": done.stderr[-1500:]}
            print(f"{variant}: FAILED\n{done.stderr[-1500:]}")
            continue
        out[variant] = json.loads(lines[-1][len("RESULT "):])
        r = out[variant]
        print(f"{variant:14s} step {r['median'] * 1e3:7.1f} ms (min {r['min'] * 1e3:.1f}, max {r['max'] * 1e3:.1f}) "
              f"peak RSS {r['peak_rss_bytes'] / 2**20:7.0f} MiB (+{r['fit_rss_growth_bytes'] / 2**20:.0f} in fit)")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["optim", "e2e", "all"], default="all")
    parser.add_argument("--sizes", type=int, nargs="+", default=[25, 100], help="millions of parameters")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--worker", choices=sorted(E2E_VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(e2e_worker(args.worker, args.steps, args.cache)))
        from lit_speed.run.process_end import end_distributed_process

        end_distributed_process()  # a ZeRO run's gloo group: exit 0 without the finalization that can abort (-6)
        return
    results: dict[str, Any] = {}
    log = []
    load = os.getloadavg()[0]  # this is a shared machine: record how busy it was
    if args.part in ("optim", "all"):
        for million in args.sizes:
            r = results[f"optim_{million}M"] = bench_optimizers(million, args.repeats)
            base = r["adamw_default"]["median"]
            for name, s in r.items():
                print(f"{million:4d}M {name:20s} {s['median'] * 1e3:8.1f} ms  ({base / s['median']:.2f}x default)")
            log.append(f"{million}M params: " + ", ".join(f"{k} {v['median'] * 1e3:.0f} ms" for k, v in r.items())
                       + f" (CPU Adam {r['adamw_fused']['median'] / r['deepspeed_cpu_adam']['median']:.2f}x fused, "
                       f"{base / r['deepspeed_cpu_adam']['median']:.2f}x default)")
    if args.part in ("e2e", "all"):
        r = results["e2e_charlm"] = bench_e2e(args.steps)
        ok = {k: v for k, v in r.items() if "median" in v}
        if "auto" in ok:
            base = ok["auto"]
            log.append("charlm_cpu 1 process, step time / fit RSS growth vs auto: " + ", ".join(
                f"{k} {v['median'] / base['median']:.2f}x / {v['fit_rss_growth_bytes'] / 2**20:.0f} MiB"
                for k, v in ok.items()))
    previous = ROOT / "benchmarks" / "results" / "bench_zero.json"
    if previous.exists() and args.part != "all":  # a partial run keeps the other part's last numbers
        kept = json.loads(previous.read_text()).get("results", {})
        results = {**{k: v for k, v in kept.items() if k not in results}, **results}
    results[f"load_average_{args.part}"] = load
    log.append(f"load average {load:.1f} at start")
    write_result("bench_zero", results, "; ".join(log))


if __name__ == "__main__":
    main()
