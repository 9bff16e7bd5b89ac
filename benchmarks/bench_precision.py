"""Per-step time, peak memory and activation memory of 32-true / bf16-mixed / 16-mixed (GuardedPrecision).

    python benchmarks/bench_precision.py [--rounds 2] [--workloads digits charlm]

Each (workload, mode) runs in a fresh subprocess (clean peak RSS: RSS before the training loop vs
``ru_maxrss`` after, as in MEASUREMENTS.md), through a real ``Trainer`` with the plugin; per-step time is
taken between ``on_train_batch_start`` and ``on_train_batch_end`` after warm-up steps. Rounds interleave the
modes so machine noise hits all of them alike; ratios to 32-true are computed from medians of the same run.
Activation memory = bytes of the distinct tensors autograd saves for backward in one training step.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, stats, write_result  # noqa: E402

MODES = ("32-true", "bf16-mixed", "16-mixed")
STEPS = {"digits": (10, 50), "charlm": (5, 30)}  # (warm-up, timed) training steps


def _child(workload: str, mode: str) -> dict:
    import functools
    import logging
    import warnings

    import lightning.pytorch as pl
    import torch

    from lit_speed import GuardedPrecision
    from lit_speed.data.charlm import CharLMDataModule
    from lit_speed.data.digits import DigitsDataModule
    from lit_speed.models.gpt import GPTModule
    from lit_speed.models.mlp import MLPClassifier

    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    pl.seed_everything(0, verbose=False)
    opt = functools.partial(torch.optim.AdamW, lr=1e-3)
    if workload == "digits":  # the default run: MLP 64-256-256-10, batch 64
        model, data = MLPClassifier(optimizer=opt), DigitsDataModule(batch_size=64)
    else:  # experiment=charlm_cpu: 0.8M-parameter GPT, 4 layers, 4 heads, 128 embd, block 64, batch 12
        model = GPTModule(block_size=64, n_layer=4, n_head=4, n_embd=128, optimizer=opt)
        data = CharLMDataModule(str(ROOT / ".cache" / "charlm"), block_size=64, batch_size=12)
    warmup, timed = STEPS[workload]
    times: list[float] = []

    class Timer(pl.Callback):
        def on_train_batch_start(self, *args) -> None:
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, *args) -> None:
            if trainer.global_step > warmup:
                times.append(time.perf_counter() - self.t0)

    plugin = GuardedPrecision(mode)
    trainer = pl.Trainer(accelerator="cpu", devices=1, plugins=[plugin], max_steps=warmup + timed, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Timer()])
    data.setup("fit")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    trainer.fit(model, datamodule=data)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    batch = next(iter(data.train_dataloader()))
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    model.train()
    x, y = batch
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), plugin.forward_context():
        logits = model(x)  # what training_step does, without self.log (no loop is running here)
        torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), y.flatten())
    return {"step_s": times, "rss_before_bytes": rss_before, "peak_rss_bytes": peak, "loadavg_1m": os.getloadavg()[0],
            "activation_bytes": sum(seen.values()), "skipped_steps": plugin.counters.skipped_steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workloads", nargs="+", default=["digits", "charlm"], choices=sorted(STEPS))
    parser.add_argument("--child", nargs=2, metavar=("WORKLOAD", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(_child(*args.child)))
        return
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    raw: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for workload in args.workloads:
            for mode in MODES:
                out = subprocess.run([sys.executable, __file__, "--child", workload, mode], env=env, cwd=ROOT,
                                     capture_output=True, text=True, check=True).stdout
                res = json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:])
                raw.setdefault(f"{workload}/{mode}", []).append(res)
                print(f"round {r} {workload:7s} {mode:10s} median step {statistics.median(res['step_s']) * 1e3:7.2f} ms"
                      f"  peak-before {(res['peak_rss_bytes'] - res['rss_before_bytes']) / 2**20:6.1f} MiB"
                      f"  activations {res['activation_bytes'] / 2**20:6.2f} MiB  load {res['loadavg_1m']:.1f}", flush=True)
    results, parts = {}, []
    for workload in args.workloads:
        base = None
        for mode in MODES:
            runs = raw[f"{workload}/{mode}"]
            step = stats([statistics.median(r["step_s"]) for r in runs])
            grow = statistics.median(r["peak_rss_bytes"] - r["rss_before_bytes"] for r in runs)
            act = runs[0]["activation_bytes"]
            base = base or {"step": step["median"], "grow": grow, "act": act}
            results[f"{workload}/{mode}"] = {
                "step_s": step, "peak_rss_bytes": statistics.median(r["peak_rss_bytes"] for r in runs),
                "rss_growth_bytes": grow, "activation_bytes": act,
                "step_time_ratio_vs_32": step["median"] / base["step"],
                "activation_ratio_vs_32": act / base["act"],
                "rss_growth_ratio_vs_32": grow / base["grow"] if base["grow"] else None}
            if mode != "32-true":
                parts.append(f"{workload} {mode}: step x{step['median'] / base['step']:.2f}, activations "
                             f"x{act / base['act']:.2f}")
    loads = [r["loadavg_1m"] for runs in raw.values() for r in runs]
    results["config"] = {"rounds": args.rounds, "steps": STEPS, "modes": MODES,
                         "loadavg_1m_range": [min(loads), max(loads)]}  # a shared machine: read ratios with this
    print(json.dumps({k: v for k, v in results.items() if k != "config"}, indent=1, default=str))
    write_result("bench_precision", results,
                 "GuardedPrecision vs 32-true (ratios of median per-step time, saved-activation bytes): "
                 + "; ".join(parts) + f" (1-min load average {min(loads):.0f}-{max(loads):.0f} on the shared box)")


if __name__ == "__main__":
    main()
