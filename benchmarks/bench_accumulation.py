"""AccumulationScheduler: its overhead vs Lightning's built-in accumulation, and a batch ramp vs a fixed batch.

    python benchmarks/bench_accumulation.py [--repeats 5] [--micro-batches 96] [--seeds 0 1 2] [--target 0.95]

1. Overhead: the same fixed factor 4 through ``Trainer(accumulate_grad_batches=4)`` and through
   ``AccumulationScheduler(factors={0: 4})``, training-loop seconds for N micro-batches (no validation),
   on the default digits MLP (batch 64) and the ``experiment=charlm_cpu`` GPT (batch 12). Warm-up run
   first; the variants alternate within each repeat; median and spread, ratio callback / built-in.
2. Ramp vs fixed (digits MLP, AdamW lr 1e-3 x sqrt scaling): micro-batches, samples and training seconds
   until val/acc >= target (validated every 5 micro-batches) for a fixed effective batch 256 (64 x 4), a
   ramp 64 -> 256 over the first 40 optimizer steps, and plain 64 x 1, same seeds and init per variant.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from _common import ROOT, stats, write_result  # noqa: E402

from lit_speed.accumulation import AccumulationScheduler  # noqa: E402
from lit_speed.data.charlm import CharLMDataModule  # noqa: E402
from lit_speed.data.digits import DigitsDataModule  # noqa: E402
from lit_speed.models.gpt import GPTModule  # noqa: E402
from lit_speed.models.mlp import MLPClassifier  # noqa: E402


class TrainClock(pl.Callback):
    """Wall and CPU seconds inside training batches (validation excluded); stops at a val/acc target.

    CPU time (``time.thread_time``, one torch thread) leaves out the time spent waiting for a core, so it is
    the steadier measure on a shared machine; wall time is reported too.
    """

    def __init__(self, target: float | None = None) -> None:
        self.target, self.seconds, self.cpu_seconds, self.batches, self.reached = target, 0.0, 0.0, 0, None
        self._t0 = self._c0 = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._t0, self._c0 = time.perf_counter(), time.thread_time()

    def on_train_batch_end(self, *args: Any) -> None:
        self.seconds += time.perf_counter() - self._t0
        self.cpu_seconds += time.thread_time() - self._c0
        self.batches += 1

    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        acc = trainer.callback_metrics.get("val/acc")
        if self.target is not None and self.reached is None and acc is not None and float(acc) >= self.target:
            self.reached = {"micro_batches": self.batches, "optimizer_steps": trainer.global_step,
                            "train_s": round(self.seconds, 3), "train_cpu_s": round(self.cpu_seconds, 3)}
            trainer.should_stop = True


def _trainer(callbacks: list, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      default_root_dir=tempfile.mkdtemp(), callbacks=callbacks, **kwargs)


def overhead_run(workload: str, variant: str, micro_batches: int, cache: str) -> tuple[float, float, int]:
    pl.seed_everything(0)
    if workload == "digits":
        model, dm = MLPClassifier(optimizer=partial(torch.optim.AdamW, lr=1e-3)), DigitsDataModule(batch_size=64)
    else:
        model = GPTModule(optimizer=partial(torch.optim.AdamW, lr=3e-3))
        dm = CharLMDataModule(cache_dir=cache, batch_size=12, max_bytes=400_000)
    clock = TrainClock()
    callbacks = [clock] + ([AccumulationScheduler(factors={0: 4})] if variant == "callback" else [])
    extra = {"accumulate_grad_batches": 4} if variant == "builtin" else {}
    _trainer(callbacks, max_steps=micro_batches // 4, limit_val_batches=0, **extra).fit(model, datamodule=dm)
    return clock.seconds, clock.cpu_seconds, clock.batches


def ramp_run(variant: str, seed: int, target: float, max_micro: int) -> dict:
    pl.seed_everything(seed)
    model = MLPClassifier(optimizer=partial(torch.optim.AdamW, lr=1e-3))
    dm = DigitsDataModule(batch_size=64)
    clock = TrainClock(target)
    schedules = {"fixed_256": dict(effective_batch={0: 256}, lr_scaling="sqrt"),
                 "ramp_64_256": dict(effective_batch={0: 64, 40: 256}, ramp="linear", lr_scaling="sqrt"),
                 "plain_64": dict(factors={0: 1})}
    # lr_scaling is relative to each schedule's first effective batch: 1e-3 at 64, 2e-3 at 256
    if variant == "fixed_256":
        model.optimizer_factory = partial(torch.optim.AdamW, lr=2e-3)
    callbacks = [clock, AccumulationScheduler(**schedules[variant])]
    _trainer(callbacks, max_epochs=-1, max_steps=max_micro, val_check_interval=5, check_val_every_n_epoch=None,
             limit_train_batches=1.0).fit(model, datamodule=dm)
    return clock.reached or {"micro_batches": None, "optimizer_steps": None, "train_s": None, "train_cpu_s": None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--micro-batches", type=int, default=96)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--max-micro", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier ratios on a shared CPU)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cache = str(ROOT / ".cache" / "charlm")
    results: dict[str, Any] = {"overhead": {}, "ramp": {}, "args": vars(args)}
    for workload in ("digits", "charlm"):
        for variant in ("builtin", "callback"):  # warm-up (imports, corpus build, first-iteration allocations)
            overhead_run(workload, variant, 8, cache)
        times: dict[str, list[float]] = {"builtin": [], "callback": []}
        cpu: dict[str, list[float]] = {"builtin": [], "callback": []}
        batches: set[int] = set()
        for r in range(args.repeats):
            order = ("builtin", "callback") if r % 2 == 0 else ("callback", "builtin")
            for variant in order:
                seconds, cpu_seconds, n = overhead_run(workload, variant, args.micro_batches, cache)
                times[variant].append(seconds)
                cpu[variant].append(cpu_seconds)
                batches.add(n)
        if len(batches) != 1:  # both variants must do the same work (epoch ends make ragged windows in both)
            raise RuntimeError(f"{workload}: the variants ran different numbers of micro-batches: {sorted(batches)}")
        ratios = [c / b for b, c in zip(times["builtin"], times["callback"])]
        cpu_ratios = [c / b for b, c in zip(cpu["builtin"], cpu["callback"])]
        results["overhead"][workload] = {"wall_s": {v: stats(t) for v, t in times.items()},
                                         "cpu_s": {v: stats(t) for v, t in cpu.items()},
                                         "ratio_callback_over_builtin": stats(ratios),
                                         "cpu_ratio_callback_over_builtin": stats(cpu_ratios),
                                         "micro_batches": batches.pop()}
        print(workload, "wall", {v: round(statistics.median(t), 3) for v, t in times.items()},
              "ratio", round(statistics.median(ratios), 3), "| cpu", {v: round(statistics.median(t), 3) for v, t in cpu.items()},
              "ratio", round(statistics.median(cpu_ratios), 3))
    variants = ("plain_64", "fixed_256", "ramp_64_256")
    results["ramp"] = {v: [] for v in variants}
    for seed in args.seeds:  # variants back to back per seed, so load drift on a shared machine hits all alike
        for variant in variants:
            results["ramp"][variant].append(ramp_run(variant, seed, args.target, args.max_micro))
    for variant, runs in results["ramp"].items():
        print(variant, runs)

    def med(variant: str, key: str) -> float | None:
        vals = [r[key] for r in results["ramp"][variant] if r[key] is not None]
        return statistics.median(vals) if vals else None

    ov = results["overhead"]
    line = ("accumulation x4 callback/built-in train time, wall (cpu): "
            + ", ".join(f"{w} {ov[w]['ratio_callback_over_builtin']['median']:.3f}x "
                        f"({ov[w]['cpu_ratio_callback_over_builtin']['median']:.3f}x)" for w in ov)
            + f" (median of {args.repeats}); "
            f"digits to val/acc>={args.target} (median of seeds {args.seeds}), micro-batches / train wall s (cpu s): "
            + ", ".join(f"{v} {med(v, 'micro_batches')} / {med(v, 'train_s')} ({med(v, 'train_cpu_s')} cpu)"
                        for v in results["ramp"]))
    write_result("accumulation", results, line)


if __name__ == "__main__":
    main()
