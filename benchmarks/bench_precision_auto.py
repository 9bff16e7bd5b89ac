"""Is ``precision=auto`` within 5% of the fastest fixed mode on the time-to-target workload? (issue 15)

    python benchmarks/bench_precision_auto.py [--rounds 3] [--steps 600] [--experiment charlm_fast]

Each variant is a fresh ``scripts/train.py experiment=charlm_fast precision=<mode>`` process running the
preset's first ``--steps`` optimizer steps (600: where the preset reaches val/loss 1.80 in the race) without
validation, so only precision differs. Variants: the fixed modes auto chooses from (32-true, bf16-mixed,
bf16-master), ``auto (cold)``: no timing cache (it times the three modes in the run, as on a user's first
run), and ``auto (cached)``: the on-disk timing cache written by one untimed auto run before the rounds.
Rounds interleave the variants in a rotating order; the clock is process launch to exit (what the user waits
for) and the fit time from ``summary.json``. Ratio = median of auto / the smallest median of the fixed modes.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, write_result  # noqa: E402

FIXED = ("32-true", "bf16-mixed", "bf16-master")
VARIANTS = FIXED + ("auto (cold)", "auto (cached)")


def run(variant: str, args: argparse.Namespace, out: Path, cache_dir: Path) -> dict:
    """One training process; its wall seconds, fit seconds and the mode the plugin ran in."""
    mode = variant.split()[0]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "LIT_SPEED_CACHE_DIR": str(cache_dir),
           "LIT_SPEED_AUTO_CACHE": "0" if variant == "auto (cold)" else "1"}
    cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), f"experiment={args.experiment}", f"precision={mode}",
           f"trainer.max_steps={args.steps}", "validate=false", "trainer.limit_val_batches=0", "logger=none",
           f"seed={args.seed}", f"hydra.run.dir={out}"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    chosen = summary["components"]["GuardedPrecision"]
    return {"wall_s": round(wall, 2), "fit_s": summary["fit_wall_time_s"], "mode": chosen["mode"],
            "reason": chosen["reason"], "steps": summary["global_step"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--experiment", default="charlm_fast")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated subset of: " + ", ".join(VARIANTS) + " (at least one fixed mode)")
    args = parser.parse_args()
    variants = tuple(v.strip() for v in args.variants.split(","))
    if set(variants) - set(VARIANTS) or not set(variants) & set(FIXED):
        parser.error(f"--variants: choose from {', '.join(VARIANTS)}, with at least one of {', '.join(FIXED)}")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        run("auto (cached)", args, Path(tmp) / "fill", cache)  # writes the timing cache; not counted
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        for r in range(args.rounds):
            for v in variants[r % len(variants):] + variants[:r % len(variants)]:
                runs[v].append(run(v, args, Path(tmp) / f"{r}-{re.sub(r'[^a-z0-9-]+', '_', v)}", cache))
                print(f"round {r} {v:14s} {runs[v][-1]['wall_s']:6.1f} s wall, fit {runs[v][-1]['fit_s']:6.1f} s "
                      f"({runs[v][-1]['mode']})", flush=True)
    load_after = os.getloadavg()
    med = {v: {k: statistics.median(x[k] for x in runs[v]) for k in ("wall_s", "fit_s")} for v in variants}
    autos = [v for v in ("auto (cold)", "auto (cached)") if v in variants]
    ratios = {}
    for clock in ("wall_s", "fit_s"):
        fastest = min((m for m in FIXED if m in variants), key=lambda m: med[m][clock])
        ratios[clock] = {"fastest_fixed": fastest, **{v: round(med[v][clock] / med[fastest][clock], 3) for v in autos}}
    print(f"\n{'variant':15s} {'wall s (median)':>16s} {'fit s (median)':>15s}  modes chosen")
    for v in variants:
        print(f"{v:15s} {med[v]['wall_s']:16.1f} {med[v]['fit_s']:15.1f}  {', '.join(x['mode'] for x in runs[v])}")
    for clock, r in ratios.items():
        shown = ", ".join(f"{v} x{r[v]:.3f}" for v in autos)
        print(f"{clock}: fastest fixed mode {r['fastest_fixed']}; {shown} (goal <= x1.05)")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    results = {"args": vars(args), "runs": runs, "median": med, "ratios": ratios,
               "load_before": load_before, "load_after": load_after}
    w = ratios["wall_s"]
    fixed = ", ".join(f"{m} {med[m]['wall_s']:.1f}" for m in FIXED if m in variants)
    shown = "; ".join(f"{v} x{w[v]:.3f} wall / x{ratios['fit_s'][v]:.3f} fit (chose "
                      f"{', '.join(x['mode'] for x in runs[v])})" for v in autos)
    write_result("precision_auto", results,
                 f"precision=auto on {args.experiment}, {args.steps} steps, {args.rounds} rounds, launch-to-exit "
                 f"medians: {fixed} s; {shown}; load {load_before[0]:.1f} -> {load_after[0]:.1f}")


if __name__ == "__main__":
    main()
