"""Cost of DeviceStatsLogger on the charlm step, next to Lightning's DeviceStatsMonitor, and the charlm MFU.

    python benchmarks/bench_stats_overhead.py [--steps 80] [--rounds 3] [--warmup 10] [--threads 1]

Workload: the ``experiment=charlm_cpu`` GPT (4 layers, 4 heads, 128 embd, block 64, batch 12, AdamW foreach),
CSV logger on in every variant so logging costs the same, no validation, no checkpoints. Variants:
``none`` (no stats callback), ``ours`` (DeviceStatsLogger, interval = log_every_n_steps = 20) and
``lightning`` (DeviceStatsMonitor). Two measures of the overhead:

- end to end: steady-state step time (after ``--warmup`` steps), wall and process CPU time, variants
  interleaved round by round with a rotating order, reported as the median of per-round ratios against
  ``none`` (wall time is noisy on a shared machine; CPU time per step much less so);
- self time: wall time spent inside the callback's own hooks per step, over the ``none`` step time (precise).

The one-off costs of ours (CPU peak probe, FLOP counting on the first batch) fall in the warm-up and are
reported on their own.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from _common import ROOT, stats, write_result  # noqa: E402
from lightning.pytorch.callbacks import Callback, DeviceStatsMonitor  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from lit_speed.data.charlm import CharLMDataModule  # noqa: E402
from lit_speed.models.gpt import GPTModule  # noqa: E402
from lit_speed.monitoring import DeviceStatsLogger  # noqa: E402
from lit_speed.monitoring import flops as flops_module  # noqa: E402

HOOKS = ("on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end", "on_train_start")


class StepClock(Callback):
    """Wall and process-CPU timestamps at the end of every training batch."""

    def __init__(self) -> None:
        self.ends: list[tuple[float, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.ends.append((time.perf_counter(), time.process_time()))

    def step_ms(self, warmup: int, which: int = 0) -> float:
        ends = [e[which] for e in self.ends[warmup:]]
        return 1000 * (ends[-1] - ends[0]) / (len(ends) - 1)


def self_timed(callback: Callback) -> tuple[Callback, dict[str, list[float]]]:
    """Wrap the callback's hooks so the seconds spent inside each call are recorded (per hook, in call order)."""
    spent: dict[str, list[float]] = {hook: [] for hook in HOOKS}
    for hook in HOOKS:
        original = getattr(callback, hook)

        def timed(*args, _original=original, _hook=hook, **kwargs):
            t0 = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                spent[_hook].append(time.perf_counter() - t0)

        setattr(callback, hook, timed)
    return callback, spent


def run(variant: str, steps: int, warmup: int, out: Path) -> dict:
    pl.seed_everything(0, verbose=False)
    dm = CharLMDataModule(cache_dir=str(ROOT / ".cache" / "charlm"), block_size=64, batch_size=12)
    model = GPTModule(block_size=64, n_layer=4, n_head=4, n_embd=128, dropout=0.0,
                      optimizer=partial(torch.optim.AdamW, lr=3e-3, betas=(0.9, 0.99), foreach=True))
    clock = StepClock()
    callbacks: list[Callback] = [clock]
    spent: dict[str, list[float]] = {}
    stats_cb = None
    if variant == "ours":
        stats_cb, spent = self_timed(DeviceStatsLogger(dirpath=str(out), verbose=False))
    elif variant == "lightning":
        stats_cb, spent = self_timed(DeviceStatsMonitor())
    if stats_cb is not None:
        callbacks.append(stats_cb)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, callbacks=callbacks, log_every_n_steps=20,
                         limit_val_batches=0, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=out,
                         logger=CSVLogger(out, name=variant, version=""))
    trainer.fit(model, datamodule=dm)
    step_ms = clock.step_ms(warmup)
    # self time of the steady-state steps (one call per batch and hook, no accumulation): the one-off work of
    # on_train_start and of the warm-up batches (FLOP counting) is left out, as it is from step_ms
    steady = sum(sum(spent.get(h, [])[warmup:]) for h in HOOKS[:3])
    result = {"step_ms": step_ms, "cpu_ms": clock.step_ms(warmup, which=1), "self_us_per_step": 1e6 * steady / (steps - warmup),
              "warmup_self_s": sum(sum(spent.get(h, [])[:warmup]) for h in HOOKS[:3]),
              "on_train_start_s": sum(spent.get("on_train_start", []))}
    if variant == "ours":
        summary = stats_cb.final_summary()
        result.update({"flops_per_batch": summary["flops_per_batch"], "peak_flops": summary["peak_flops"],
                       "peak_flops_source": summary["peak_flops_source"], "mfu": summary["evidence"].get("mfu"),
                       "flops_per_sec": summary["evidence"].get("flops_per_sec"), "verdict": summary["summary"],
                       "time_split": {k: summary["evidence"][k] for k in
                                      ("data_wait_frac", "forward_backward_frac", "optimizer_frac")}})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads; 1 on a shared machine, where 2 OpenMP threads per process oversubscribe")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = ["none", "ours", "lightning"]
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    ratios: dict[str, list[float]] = {"ours": [], "lightning": []}
    cpu_ratios: dict[str, list[float]] = {"ours": [], "lightning": []}
    with tempfile.TemporaryDirectory() as tmp:
        # untimed warm-up fit: corpus cache, allocator, thread pools
        run("none", args.warmup + 2, 1, Path(tmp) / "warm")
        for r in range(args.rounds):
            order = variants[r % 3:] + variants[:r % 3]
            this_round = {}
            for v in order:
                this_round[v] = run(v, args.steps, args.warmup, Path(tmp) / f"{v}{r}")
                runs[v].append(this_round[v])
                print(f"round {r} {v:9s} {this_round[v]['step_ms']:.2f} ms/step wall, "
                      f"{this_round[v]['cpu_ms']:.2f} ms/step CPU", flush=True)
            for v in ratios:
                ratios[v].append(this_round[v]["step_ms"] / this_round["none"]["step_ms"])
                cpu_ratios[v].append(this_round[v]["cpu_ms"] / this_round["none"]["cpu_ms"])
    t0 = time.perf_counter()
    flops_module._cached_cpu_peak.cache_clear()
    flops_module.measure_cpu_peak_flops(torch.float32)
    probe_s = time.perf_counter() - t0

    none_ms = stats([r["step_ms"] for r in runs["none"]])["median"]
    results = {"workload": "charlm GPT 4L/4H/128, block 64, batch 12, AdamW foreach, fp32, CSV logger",
               "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "cpu_peak_probe_s": probe_s,
               "torch_threads": torch.get_num_threads()}
    for v in variants:
        results[v] = {"step_ms": stats([r["step_ms"] for r in runs[v]]), "cpu_ms": stats([r["cpu_ms"] for r in runs[v]]),
                      "self_us_per_step": stats([r["self_us_per_step"] for r in runs[v]]) if v != "none" else None}
        if v in ratios:
            results[v]["ratio_vs_none"] = stats(ratios[v])
            results[v]["cpu_ratio_vs_none"] = stats(cpu_ratios[v])
            results[v]["self_time_frac"] = results[v]["self_us_per_step"]["median"] / 1000 / none_ms
    last = runs["ours"][-1]
    results["ours"].update({k: last[k] for k in ("flops_per_batch", "peak_flops", "peak_flops_source", "mfu",
                                                "flops_per_sec", "verdict", "time_split")})
    for key in ("on_train_start_s", "warmup_self_s"):
        results["ours"][key] = stats([r[key] for r in runs["ours"]])
    ours, light = results["ours"], results["lightning"]
    def span(d: dict) -> str:
        return f"{d['median']:.3f} [{d['min']:.3f}-{d['max']:.3f}]"

    line = (f"charlm step {none_ms:.1f} ms wall (none, {torch.get_num_threads()} thread(s)); ratio vs none, wall: ours "
            f"{span(ours['ratio_vs_none'])}, Lightning DeviceStatsMonitor {span(light['ratio_vs_none'])}; CPU time: "
            f"ours {span(ours['cpu_ratio_vs_none'])}, Lightning {span(light['cpu_ratio_vs_none'])} "
            f"({args.rounds} interleaved rounds x {args.steps} steps); hook self "
            f"time ours {ours['self_us_per_step']['median']:.0f} us/step = {100 * ours['self_time_frac']:.2f}% vs "
            f"Lightning {light['self_us_per_step']['median']:.0f} us/step = {100 * light['self_time_frac']:.2f}%; "
            f"one-off CPU peak probe {probe_s:.2f} s; charlm {ours['flops_per_batch'] / 1e9:.2f} GFLOP/step, "
            f"{ours['flops_per_sec'] / 1e9:.1f} GFLOP/s = MFU {100 * ours['mfu']:.0f}% of the "
            f"{ours['peak_flops'] / 1e9:.0f} GFLOP/s fp32 probe; verdict: {ours['verdict']}")
    print(line)
    write_result("bench_stats_overhead", results, line)


if __name__ == "__main__":
    main()
