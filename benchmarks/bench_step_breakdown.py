"""Where a charlm_fast run's time goes, and how far each part is from its limit, beside plain Lightning's.

    python benchmarks/bench_step_breakdown.py                 # 400 optimizer steps each, validation every 100 batches
    python benchmarks/bench_step_breakdown.py --steps 30      # smoke mode: nothing written

Two fresh processes on the same GPT (4 layers, 4 heads, 128 wide, block 64) and corpus:

- ``lit_speed``: ``scripts/train.py experiment=charlm_fast callbacks=[device_stats]`` (the preset, with lit_speed's
  stats logger), Lightning's validation on 512 windows every 100 training batches;
- ``plain_lightning``: the same ``GPTModule`` with AdamW 1e-3 in a plain ``Trainer`` (fp32, no lit_speed component but
  the stats logger), validated the same way.

Per variant: start-up (process launch to the first training batch; the floor is ``import torch, lightning`` alone),
forward+backward per micro-batch with its MFU against the measured matmul peak of the dtype the step runs in, the
optimizer step (for Muon, its Newton-Schulz FLOPs against the same peak), and one validation pass (its MFU).
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
from _common import ROOT, write_result

HERE = Path(__file__).resolve().parent
CACHE = str(ROOT / ".cache" / "charlm")
VAL_EVERY, VAL_BATCHES = 100, 8  # 8 batches of 64 windows = 512 windows per validation


def val_every(steps: int) -> int:
    """Training batches between validations: 100, or a third of a short (smoke) run."""
    return min(VAL_EVERY, max(1, steps // 3))


def child_plain(steps: int, out: str, launch_out: str) -> None:
    """Plain Lightning around the same GPTModule: AdamW 1e-3, fp32, Trainer defaults but the shared validation."""
    import lightning.pytorch as pl
    import torch
    from launch_clock import LaunchClock

    from lit_speed import CharLMDataModule, DeviceStatsLogger, GPTModule

    pl.seed_everything(42)
    model = GPTModule(n_layer=4, n_head=4, n_embd=128, block_size=64,
                      optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.99)))
    stats = DeviceStatsLogger()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, val_check_interval=val_every(steps),
                             check_val_every_n_epoch=None, limit_val_batches=VAL_BATCHES, num_sanity_val_steps=0,
                             callbacks=[stats, LaunchClock(launch_out)], default_root_dir=tmp, logger=False,
                             enable_checkpointing=False)
        start = time.perf_counter()
        trainer.fit(model, datamodule=CharLMDataModule(cache_dir=CACHE, block_size=64, batch_size=12))
        fit_s = time.perf_counter() - start
    Path(out).write_text(json.dumps({"components": {"DeviceStatsLogger": stats.final_summary()},
                                     "global_step": trainer.global_step, "fit_wall_time_s": fit_s,
                                     "precision": "32-true"}))


def run(variant: str, steps: int) -> dict[str, Any]:
    """One fresh process; its summary (the stats logger's verdict) and launch-clock events, and its wall time."""
    with tempfile.TemporaryDirectory() as tmp:
        out, launch = f"{tmp}/summary.json", f"{tmp}/launch.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")])}
        if variant == "lit_speed":
            cmd = [sys.executable, "scripts/train.py", "experiment=charlm_fast", "callbacks=[device_stats]",
                   f"trainer.max_steps={steps}", f"trainer.val_check_interval={val_every(steps)}",
                   f"trainer.limit_val_batches={VAL_BATCHES}", "trainer.num_sanity_val_steps=0", "logger=none",
                   "validate=false", "trainer.enable_progress_bar=false",
                   "+callbacks.launch._target_=launch_clock.LaunchClock", f"+callbacks.launch.out_path={launch}",
                   f"hydra.run.dir={tmp}/run"]
        else:
            cmd = [sys.executable, __file__, "--child", "--steps", str(steps), "--out", out, "--launch-out", launch]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{variant} failed:\n{proc.stderr[-3000:]}")
        summary = json.loads(Path(f"{tmp}/run/summary.json" if variant == "lit_speed" else out).read_text())
        return {"summary": summary, "launch": json.loads(Path(launch).read_text()), "wall_s": wall}


def import_floor() -> float:
    """Seconds from launch to exit of ``python -c 'import torch, lightning'`` (what every variant pays first)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, lightning.pytorch"], check=True)
    return time.perf_counter() - start


def newton_schulz_flops(ns_dtype: str, steps: int = 5) -> float:
    """FLOPs of one Muon step's Newton-Schulz on the GPT's 16 hidden matrices (oriented wide: r <= c), in the form
    BatchedMuon runs for ``ns_dtype`` (the standard iteration, or its Gram form: ``batched_muon.gram_flops``)."""
    import torch

    from lit_speed.optim.batched_muon import gram_flops, use_gram_form

    shapes = [(128, 384), (128, 128), (128, 512), (128, 512)] * 4  # qkv, proj, fc, fc-out per block
    dtype = getattr(torch, ns_dtype)
    return float(sum(gram_flops(r, c, steps)[use_gram_form(r, c, steps, dtype)] for r, c in shapes))


def breakdown(result: dict[str, Any], floor_s: float) -> dict[str, Any]:
    """The table row of one variant: each part's time, share and distance from its limit."""
    summary = result["summary"]
    stats = summary["components"]["DeviceStatsLogger"]
    ev = stats["evidence"]
    peak = stats.get("peak_flops")
    flops = stats.get("flops_per_batch") or 0.0
    batches, steps = ev["batches"], summary["global_step"]
    fb_ms = 1000 * ev["forward_backward_s"] / batches
    opt_ms = 1000 * ev["optimizer_s"] / max(steps - 1, 1)
    muon = summary["components"].get("MuonAdamW")
    out: dict[str, Any] = {
        "precision": summary["components"].get("GuardedPrecision", {}).get("mode", summary.get("precision")),
        "peak_source": stats.get("peak_flops_source"), "peak_gflops": peak and round(peak / 1e9, 1),
        "startup_s": result["launch"]["events"]["first_batch_start"], "import_floor_s": round(floor_s, 2),
        "forward_backward_ms": round(fb_ms, 2), "forward_backward_mfu": peak and round(flops / (fb_ms / 1000) / peak, 3),
        "optimizer_ms": round(opt_ms, 2),
        "optimizer_mfu_newton_schulz": (round(newton_schulz_flops(muon["ns_dtype"]) / (opt_ms / 1000) / peak, 3)
                                        if muon and peak else None),
        "wall_s": round(result["wall_s"], 2), "fit_s": round(summary["fit_wall_time_s"], 2),
    }
    passes = result["launch"].get("validations_s") or []
    if passes:
        per = sorted(passes)[len(passes) // 2]  # median pass
        out["validation_s"], out["validations"] = round(per, 3), len(passes)
        # forward only: a third of a training batch's FLOPs per window (12 windows a batch), 512 windows per pass
        out["validation_mfu"] = peak and round(flops / 3 / 12 * 512 / per / peak, 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--out")
    parser.add_argument("--launch-out")
    args = parser.parse_args()
    if args.child:
        child_plain(args.steps, args.out, args.launch_out)
        return
    load_start = os.getloadavg()
    floor = min(import_floor() for _ in range(3))
    rows = {name: breakdown(run(name, args.steps), floor) for name in ("lit_speed", "plain_lightning")}
    for name, row in rows.items():
        print(f"{name}: {json.dumps(row)}")
    if args.steps != parser.get_default("steps"):
        print("smoke mode (--steps given): no JSON or LOG.md line written")
        return
    lit, plain = rows["lit_speed"], rows["plain_lightning"]
    write_result("step_breakdown", {"steps": args.steps, "rows": rows, "load_average_start_end":
                                    [load_start, os.getloadavg()]},
                 f"charlm GPT {args.steps} steps: lit_speed ({lit['precision']}) fwd+bwd {lit['forward_backward_ms']} ms "
                 f"(MFU {lit['forward_backward_mfu']} of {lit['peak_source']}), optimizer {lit['optimizer_ms']} ms "
                 f"(NS MFU {lit['optimizer_mfu_newton_schulz']}), validation {lit.get('validation_s')} s, start-up "
                 f"{lit['startup_s']} s; plain Lightning fwd+bwd {plain['forward_backward_ms']} ms (MFU "
                 f"{plain['forward_backward_mfu']}), optimizer {plain['optimizer_ms']} ms, validation "
                 f"{plain.get('validation_s')} s, start-up {plain['startup_s']} s; import floor {lit['import_floor_s']} s; "
                 f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
