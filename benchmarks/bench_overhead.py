"""Framework overhead: per-step time of a plain PyTorch loop vs plain Lightning vs lit_speed's full stack.

    python benchmarks/bench_overhead.py [--steps 150] [--rounds 3] [--warmup 20] [--threads 1] [--per-component]

Workload: a tiny char GPT (1 layer, 2 heads, 32 embd, block 16, batch 4) on the charlm corpus, where
framework overhead dominates the step (the worst case for a framework). Variants, in one process:

- ``plain_loop``: benchmarks/plain_loop.py (same model, data, AdamW, warm-up + cosine schedule).
- ``lightning``: the same GPTModule in ``Trainer`` with logger, checkpointing, progress bar, model summary
  and validation off (Lightning itself, nothing else).
- ``lit_speed``: the same Trainer plus every lit_speed component that runs in a default single-process
  job: GuardedPrecision("32-true") plugin, AccumulationScheduler({0: 1}), DeviceStatsLogger, RunSummary,
  TimeToTarget. (ZeroStrategy is a different strategy, not overhead, and is measured in bench_zero.py.)

Per step: wall time and process CPU time between consecutive step starts after ``--warmup`` steps
(one-off costs such as the stats logger's FLOP count fall in the warm-up). Variants are interleaved
round by round with a rotating order; the ratios are medians of per-round ratios (CPU time is far less
noisy than wall time on a shared machine).
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time
from typing import Any

import _common  # noqa: F401 - puts the repository on sys.path
import lightning.pytorch as pl
import plain_loop
import torch
from _common import ROOT, stats, write_result

from lit_speed.data.charlm import CharLMDataModule
from lit_speed.models.gpt import GPTModule
from lit_speed.optim.schedules import warmup_cosine
from lit_speed.run.summary import RunSummary

TINY = dict(n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=4)
CACHE = str(ROOT / ".cache" / "charlm")


class StepClock(pl.Callback):
    """Wall and process-CPU time at the start of every training batch (the same clock the plain loop keeps)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())


def per_step(starts: list[float], warmup: int) -> float:
    deltas = [b - a for a, b in zip(starts[warmup:], starts[warmup + 1:])]
    return statistics.median(deltas)


def run_plain(steps: int, warmup: int) -> tuple[float, float]:
    cfg = plain_loop.LoopConfig(**TINY, max_steps=steps, val_every=0, cache_dir=CACHE)
    model, opt, sched, dm = plain_loop.build(cfg)
    wall, cpu = [], []
    it = iter(dm.train_dataloader())
    for _ in range(steps):
        wall.append(time.perf_counter())
        cpu.append(time.process_time())
        loss = plain_loop.loss_of(model, next(it))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return per_step(wall, warmup), per_step(cpu, warmup)


def lit_speed_parts(only: str | None = None) -> tuple[list[Any], list[pl.Callback]]:
    """The full stack, or one component of it (``only``) to attribute the overhead."""
    from lit_speed.accumulation.accumulation_scheduler import AccumulationScheduler
    from lit_speed.monitoring.device_stats_logger import DeviceStatsLogger
    from lit_speed.precision.guarded_precision import GuardedPrecision
    from lit_speed.reporting import TimeToTarget

    parts: dict[str, Any] = {"GuardedPrecision": GuardedPrecision("32-true"),
                             "AccumulationScheduler": AccumulationScheduler(factors={0: 1}),
                             "DeviceStatsLogger": DeviceStatsLogger(verbose=False),
                             "RunSummary": RunSummary(monitor="val/loss", mode="min"),
                             "TimeToTarget": TimeToTarget(target=0.0)}
    chosen = {only: parts[only]} if only else parts
    plugins = [p for n, p in chosen.items() if n == "GuardedPrecision"]
    return plugins, [c for n, c in chosen.items() if n != "GuardedPrecision"]


def run_lightning(steps: int, warmup: int, full_stack: bool, only: str | None = None) -> tuple[float, float]:
    torch.manual_seed(42)
    dm = CharLMDataModule(cache_dir=CACHE, block_size=TINY["block_size"], batch_size=TINY["batch_size"])
    model = GPTModule(block_size=TINY["block_size"], n_layer=TINY["n_layer"], n_head=TINY["n_head"],
                      n_embd=TINY["n_embd"], optimizer=functools.partial(torch.optim.AdamW, lr=3e-3, betas=(0.9, 0.99)),
                      scheduler=functools.partial(warmup_cosine, warmup_steps=20, min_lr_ratio=0.1))
    clock = StepClock()
    plugins, callbacks = lit_speed_parts(only) if (full_stack or only) else ([], [])
    with tempfile.TemporaryDirectory() as tmp:
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, limit_val_batches=0,
                             num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp,
                             plugins=plugins or None, callbacks=[clock, *callbacks])
        trainer.fit(model, datamodule=dm)
    return per_step(clock.wall, warmup), per_step(clock.cpu, warmup)


VARIANTS = {"plain_loop": lambda s, w: run_plain(s, w),
            "lightning": lambda s, w: run_lightning(s, w, full_stack=False),
            "lit_speed": lambda s, w: run_lightning(s, w, full_stack=True)}
COMPONENTS = ["GuardedPrecision", "AccumulationScheduler", "DeviceStatsLogger", "RunSummary", "TimeToTarget"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--per-component", action="store_true", help="also Lightning + each component alone")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pl.seed_everything(0, verbose=False)
    if args.per_component:  # Lightning + one component each: where the stack's overhead comes from
        for comp in COMPONENTS:
            VARIANTS[f"+{comp}"] = lambda s, w, c=comp: run_lightning(s, w, full_stack=False, only=c)
    names = list(VARIANTS)
    for name in names:  # one untimed pass each: imports, corpus cache, first-use kernels
        VARIANTS[name](args.warmup + 5, args.warmup)
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotate the order
            w, c = VARIANTS[name](args.steps, args.warmup)
            wall[name].append(w)
            cpu[name].append(c)
            print(f"round {r} {name:22s} wall {1e3 * w:7.3f} ms/step  cpu {1e3 * c:7.3f} ms/step", flush=True)

    def ratio(a: str, b: str, table: dict[str, list[float]]) -> dict[str, float]:
        return stats([x / y for x, y in zip(table[a], table[b])])

    results = {
        "workload": {**TINY, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "threads": args.threads},
        "load_average_start_end": None,
        "wall_ms_per_step": {n: stats([1e3 * x for x in wall[n]]) for n in names},
        "cpu_ms_per_step": {n: stats([1e3 * x for x in cpu[n]]) for n in names},
        "ratios_wall": {"lightning/plain_loop": ratio("lightning", "plain_loop", wall),
                        "lit_speed/lightning": ratio("lit_speed", "lightning", wall)},
        "ratios_cpu": {"lightning/plain_loop": ratio("lightning", "plain_loop", cpu),
                       "lit_speed/lightning": ratio("lit_speed", "lightning", cpu),
                       **{f"{n}/lightning": ratio(n, "lightning", cpu) for n in names if n.startswith("+")}},
    }
    results["load_average_start_end"] = [LOAD_AT_START, os.getloadavg()]
    rc, rw = results["ratios_cpu"], results["ratios_wall"]
    print(f"lightning / plain loop: cpu x{rc['lightning/plain_loop']['median']:.3f}, "
          f"wall x{rw['lightning/plain_loop']['median']:.3f}")
    for n in names:
        if n.startswith("+"):
            print(f"lightning {n:22s}: cpu x{rc[f'{n}/lightning']['median']:.3f}")
    print(f"lit_speed / lightning : cpu x{rc['lit_speed/lightning']['median']:.3f}, "
          f"wall x{rw['lit_speed/lightning']['median']:.3f}  (target <= 1.05)")
    write_result("overhead", results,
                 f"tiny GPT per-step, {args.rounds} rounds x {args.steps} steps: Lightning/plain loop "
                 f"cpu x{rc['lightning/plain_loop']['median']:.2f} (wall x{rw['lightning/plain_loop']['median']:.2f}); "
                 f"lit_speed stack/Lightning cpu x{rc['lit_speed/lightning']['median']:.3f} "
                 f"(wall x{rw['lit_speed/lightning']['median']:.3f}); load avg {os.getloadavg()[0]:.1f}")


LOAD_AT_START = os.getloadavg()

if __name__ == "__main__":
    main()
