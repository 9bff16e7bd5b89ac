"""Time to a target charlm val loss: lit_speed's fastest preset vs plain Lightning defaults vs a plain loop.

    python benchmarks/bench_time_to_target.py [--target 2.4] [--repeats 2] [--max-steps 1000]

Same model (the experiment=charlm_cpu GPT: 4 layers, 4 heads, 128 embd, block 64) and the same corpus
in every variant, each in its own fresh process:

- ``lit_speed``: ``scripts/train.py experiment=charlm_fast`` (the preset, as a user runs it).
- ``lightning``: GPTModule with the charlm_cpu recipe (batch 12, AdamW lr 3e-3 with torch's default
  implementation, warm-up + cosine) in ``Trainer(accelerator="cpu")`` with Lightning's defaults
  (checkpointing, logger, progress bar, model summary, sanity check).
- ``lightning_fast_recipe``: the same plain Lightning run with charlm_fast's batch size and peak LR (read
  from conf/experiment/charlm_fast.yaml): how much of the preset's gain is its recipe, not lit_speed.
- ``plain_loop``: benchmarks/plain_loop.py with the same recipe as ``lightning``, no framework.

The measuring instrument is identical for all three: validation every 25 training batches on the same
4 x 64 validation windows; the clock starts at fit start (loop start for the plain loop), so it
includes validation, checkpointing and any compilation; a run stops at its first validation with
val/loss <= target. ``--max-steps`` is also the cosine-schedule horizon of the baselines.
Reported: median wall seconds, process CPU seconds (run with OMP_NUM_THREADS=1 on a shared machine: CPU
time is then the steadier measure) and optimizer steps to target over ``--repeats`` (interleaved), and ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common  # noqa: F401 - puts the repository on sys.path
from _common import ROOT, stats, write_result

VAL_EVERY, VAL_BATCHES = 25, 4
CACHE = str(ROOT / ".cache" / "charlm")


def fast_recipe() -> dict[str, Any]:
    """Batch size and peak LR of ``experiment=charlm_fast`` (from its YAML, so they cannot drift)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(ROOT / "conf" / "experiment" / "charlm_fast.yaml")
    return {"batch_size": int(cfg.data.batch_size), "lr": float(cfg.optimizer.lr)}


def child_lightning(target: float, max_steps: int, batch_size: int = 12, lr: float = 0.003) -> dict[str, Any]:
    import functools

    import lightning.pytorch as pl
    import torch

    from lit_speed.data.charlm import CharLMDataModule
    from lit_speed.models.gpt import GPTModule
    from lit_speed.models.optim import warmup_cosine
    from lit_speed.reporting import TimeToTarget

    pl.seed_everything(42)
    dm = CharLMDataModule(cache_dir=CACHE, block_size=64, batch_size=batch_size)
    model = GPTModule(block_size=64, n_layer=4, n_head=4, n_embd=128,
                      optimizer=functools.partial(torch.optim.AdamW, lr=lr, betas=(0.9, 0.99)),
                      scheduler=functools.partial(warmup_cosine, warmup_steps=20, min_lr_ratio=0.1))
    timer = TimeToTarget(target=target, monitor="val/loss", mode="min", stop=True)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, val_check_interval=VAL_EVERY,
                             limit_val_batches=VAL_BATCHES, callbacks=[timer], default_root_dir=tmp)
        trainer.fit(model, datamodule=dm)
    return {"time_to_target_s": timer.time_to_target_s, "cpu_time_to_target_s": timer.cpu_time_to_target_s,
            "target_step": timer.target_step, "final_val": float(trainer.callback_metrics["val/loss"]), "steps": trainer.global_step}


def child_plain(target: float, max_steps: int) -> dict[str, Any]:
    import plain_loop

    cfg = plain_loop.LoopConfig(max_steps=max_steps, val_every=VAL_EVERY, val_batches=VAL_BATCHES, target=target,
                                cache_dir=CACHE)
    result = plain_loop.train(cfg)
    return {"time_to_target_s": result.time_to_target_s, "cpu_time_to_target_s": result.cpu_time_to_target_s,
            "target_step": result.target_step,
            "final_val": result.val_history[-1][2] if result.val_history else None, "steps": result.steps}


def run_lit_speed(target: float, max_steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "scripts/train.py", "experiment=charlm_fast", f"trainer.max_steps={max_steps}",
               f"trainer.val_check_interval={VAL_EVERY}", f"trainer.limit_val_batches={VAL_BATCHES}",
               "trainer.enable_progress_bar=false", "validate=false",
               "+callbacks.time_to_target._target_=lit_speed.reporting.TimeToTarget",
               f"+callbacks.time_to_target.target={target}", "+callbacks.time_to_target.stop=true",
               f"hydra.run.dir={tmp}"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"experiment=charlm_fast failed:\n{proc.stderr[-3000:]}")
        summary = json.loads((Path(tmp) / "summary.json").read_text())
    t = summary["components"]["TimeToTarget"]
    return {"time_to_target_s": t["time_to_target_s"], "cpu_time_to_target_s": t.get("cpu_time_to_target_s"),
            "target_step": t["target_step"],
            "final_val": summary["final_metrics"].get("val/loss"), "steps": summary["global_step"]}


def run_child(kind: str, target: float, max_steps: int) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, "--child", kind, "--target", str(target),
                           "--max-steps", str(max_steps)], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


VARIANTS = {"lit_speed": run_lit_speed,
            "lightning": lambda t, m: run_child("lightning", t, m),
            "lightning_fast_recipe": lambda t, m: run_child("lightning_fast_recipe", t, m),
            "plain_loop": lambda t, m: run_child("plain", t, m)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, default=2.4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=1000)
    parser.add_argument("--child", choices=["lightning", "lightning_fast_recipe", "plain"], default=None)
    args = parser.parse_args()
    if args.child:
        if args.child == "plain":
            out = child_plain(args.target, args.max_steps)
        else:
            out = child_lightning(args.target, args.max_steps,
                                  **(fast_recipe() if args.child == "lightning_fast_recipe" else {}))
        print(json.dumps(out))
        return
    load_start = os.getloadavg()
    names = list(VARIANTS)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            out = VARIANTS[name](args.target, args.max_steps)
            out["process_wall_s"] = round(time.perf_counter() - t0, 2)
            runs[name].append(out)
            print(f"repeat {r} {name:10s} {out}", flush=True)
    summary: dict[str, Any] = {}
    for name in names:
        reached = [o for o in runs[name] if o["time_to_target_s"] is not None]
        summary[name] = {"reached": f"{len(reached)}/{len(runs[name])}",
                         "time_to_target_s": stats([o["time_to_target_s"] for o in reached]) if reached else None,
                         "cpu_time_to_target_s": stats([o["cpu_time_to_target_s"] for o in reached]) if reached else None,
                         "steps_to_target": stats([o["target_step"] for o in reached]) if reached else None,
                         "process_wall_s": stats([o["process_wall_s"] for o in runs[name]])}

    def ratio(a: str, b: str, key: str = "time_to_target_s") -> float | None:
        ta, tb = summary[a][key], summary[b][key]
        return round(ta["median"] / tb["median"], 3) if ta and tb else None

    ratios = {"lit_speed/lightning": ratio("lit_speed", "lightning"), "plain_loop/lightning": ratio("plain_loop", "lightning"),
              "cpu lit_speed/lightning": ratio("lit_speed", "lightning", "cpu_time_to_target_s"),
              "cpu plain_loop/lightning": ratio("plain_loop", "lightning", "cpu_time_to_target_s"),
              "lightning_fast_recipe/lightning": ratio("lightning_fast_recipe", "lightning"),
              "lit_speed/lightning_fast_recipe": ratio("lit_speed", "lightning_fast_recipe"),
              "cpu lit_speed/lightning_fast_recipe": ratio("lit_speed", "lightning_fast_recipe",
                                                           "cpu_time_to_target_s")}
    results = {"target_val_loss": args.target, "max_steps": args.max_steps, "repeats": args.repeats,
               "val_every": VAL_EVERY, "val_batches": VAL_BATCHES, "summary": summary, "ratios": ratios,
               "runs": runs, "load_average_start_end": [load_start, os.getloadavg()]}
    for name in names:
        t = summary[name]["time_to_target_s"]
        s = summary[name]["steps_to_target"]
        print(f"{name:22s} reached {summary[name]['reached']}: "
              + (f"{t['median']:.1f} s (min {t['min']:.1f}, max {t['max']:.1f}), {s['median']:.0f} steps" if t else "n/a"))
    print(f"ratios (time to target): {ratios}  (target: lit_speed/lightning <= 0.5)")
    write_result("time_to_target", results,
                 f"charlm val/loss <= {args.target}, {args.repeats} repeats: experiment=charlm_fast / plain Lightning "
                 f"= x{ratios['lit_speed/lightning']} (same recipe in plain Lightning: x{ratios['lightning_fast_recipe/lightning']}), "
                 f"plain loop / Lightning = x{ratios['plain_loop/lightning']}; "
                 f"steps " + ", ".join(f"{n} {summary[n]['steps_to_target']['median']:.0f}" if summary[n]['steps_to_target']
                                       else f"{n} n/a" for n in names) + f"; load avg {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
