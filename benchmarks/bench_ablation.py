"""Per-technique ablation on charlm and digits: fp32 baseline, each technique alone, the best combination.

    python benchmarks/bench_ablation.py [--repeats 1] [--workloads charlm digits] [--only NAME ...]

Every variant is one fresh ``scripts/train.py`` process (clean peak RSS, no state shared) with the
baseline's overrides plus the technique's, and the same measuring instruments: RunSummary
(throughput over training batches, peak RSS, final train loss, final val metric) and TimeToTarget
(``stop=false``, so every variant trains the same number of optimizer steps). Variants are
interleaved across repeats; a variant whose config option does not exist yet is recorded as
unavailable, never silently dropped. Throughput is end to end (compilation and DeepSpeed start-up
count, as a user would see them); ``diff %`` is against the fp32 baseline of the same repeat.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import _common  # noqa: F401 - puts the repository on sys.path
from _common import ROOT, stats, write_result

COMMON = ["callbacks=none", "logger=none", "trainer.enable_progress_bar=false", "+trainer.enable_checkpointing=false"]
WORKLOADS: dict[str, dict[str, Any]] = {
    "charlm": {
        "base": ["experiment=charlm_cpu", "trainer.max_steps=150", "trainer.val_check_interval=25",
                 "trainer.limit_val_batches=4"],
        "target": ("val/loss", "min", 2.8),
        "variants": {
            "fp32 baseline": [],
            "bf16-mixed": ["precision=bf16-mixed"],
            "accumulation ramp (x1 -> x4 at step 50)": ["accumulation=fixed", "accumulation.factors=[[0,1],[50,4]]"],
            "activation checkpointing": ["callbacks=[activation_checkpointing]"],
            "compile (regional)": ["callbacks=[compile]"],
            "seq-len curriculum + early stopping": ["data=charlm_curriculum", "callbacks=[curriculum_early_stopping]",
                                                    "callbacks.curriculum_early_stopping.patience=4"],
            "zero2_offload": ["strategy=zero2_offload", "optimizer=cpu_adam"],
            "best: experiment=charlm_fast": ["experiment=charlm_fast"],
        },
    },
    "digits": {
        "base": ["trainer.max_epochs=6", "+data.preload=false"],
        "target": ("val/acc", "max", 0.9),
        "variants": {
            "fp32 baseline (per-sample loader)": [],
            "bf16-mixed": ["precision=bf16-mixed"],
            "accumulation ramp": ["accumulation=ramp"],
            "preload + batched loading": ["+data.preload=true"],
            "curriculum + early stopping": ["data=digits_curriculum", "callbacks=[curriculum_early_stopping]"],
            "zero2_offload": ["strategy=zero2_offload", "optimizer=cpu_adam"],
            "best: preload + curriculum": ["data=digits_curriculum", "callbacks=[curriculum_early_stopping]"],
        },
    },
}


def overrides_for(workload: str, variant: str) -> list[str]:
    w = WORKLOADS[workload]
    monitor, mode, target = w["target"]
    extra = w["variants"][variant]
    base = [o for o in w["base"] if not (o.startswith("experiment=") and any(e.startswith("experiment=") for e in extra))]
    if any(e.startswith("data=") or "preload" in e for e in extra):  # the variant sets the data pipeline itself
        base = [o for o in base if "data.preload" not in o]
    timer = ["+callbacks.time_to_target._target_=lit_speed.reporting.TimeToTarget",
             f"+callbacks.time_to_target.target={target}", f"+callbacks.time_to_target.monitor={monitor}",
             f"+callbacks.time_to_target.mode={mode}", "+callbacks.time_to_target.stop=false"]
    return COMMON + base + extra + timer


def available(overrides: list[str]) -> str | None:
    """None when the config composes, else the reason (a component not landed yet, a bad override)."""
    from lit_speed.run.config_check import preflight
    from lit_speed.run.config_error import ConfigError

    try:
        preflight(overrides)
    except ConfigError as error:
        return str(error)
    return None


def run(overrides: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, "scripts/train.py", *overrides, f"hydra.run.dir={tmp}"], cwd=ROOT,
                              capture_output=True, text=True)
        path = Path(tmp) / "summary.json"
        if proc.returncode != 0 or not path.exists():
            tail = proc.stderr.strip().splitlines()[-3:] if proc.stderr.strip() else [f"exit {proc.returncode}"]
            return {"status": "failed", "error": " | ".join(tail)[-600:]}
        s = json.loads(path.read_text())
    t = (s.get("components") or {}).get("TimeToTarget", {})
    monitor = s.get("monitor")
    return {"status": "ok", "samples_per_sec": s["samples_per_sec"], "tokens_per_sec": s.get("tokens_per_sec"),
            "peak_rss_mib": round(s["peak_rss_bytes"] / 2**20, 1), "final_train_loss": s.get("final_train_loss"),
            "final_val": (s.get("final_val") or {}).get(monitor, (s.get("final_metrics") or {}).get(monitor)),
            "monitor": monitor, "global_step": s["global_step"], "fit_wall_time_s": s["fit_wall_time_s"],
            "time_to_target_s": t.get("time_to_target_s"), "cpu_time_to_target_s": t.get("cpu_time_to_target_s"),
            "target_step": t.get("target_step")}


def summarise(runs: list[dict[str, Any]], baseline_runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if r["status"] == "ok"]
    if not ok:
        return {"status": "failed", "error": runs[0].get("error") if runs else "not run"}
    key = "tokens_per_sec" if ok[0].get("tokens_per_sec") else "samples_per_sec"
    out: dict[str, Any] = {"status": "ok", "runs": len(ok), "throughput_unit": key,
                           "throughput": stats([r[key] for r in ok])}
    pairs = [(r[key], b[key]) for r, b in zip(runs, baseline_runs) if r["status"] == "ok" and b["status"] == "ok"]
    out["diff_pct"] = round(100 * (statistics.median(a / b for a, b in pairs) - 1), 1) if pairs else None
    for field in ("peak_rss_mib", "final_train_loss", "final_val", "global_step"):
        values = [r[field] for r in ok if r[field] is not None]
        out[field] = statistics.median(values) if values else None
    reached = [r for r in ok if r["time_to_target_s"] is not None]
    out["reached_target"] = f"{len(reached)}/{len(ok)}"
    for field in ("time_to_target_s", "cpu_time_to_target_s", "target_step"):
        out[field] = statistics.median(r[field] for r in reached) if reached else None
    return out


def markdown(workload: str, table: dict[str, dict[str, Any]]) -> str:
    monitor, mode, target = WORKLOADS[workload]["target"]
    unit = next((v["throughput_unit"] for v in table.values() if v["status"] == "ok"), "samples_per_sec")
    lines = [f"| {workload} variant | {unit.replace('_per_sec', '/s')} | diff % | peak RSS MiB | final train loss | "
             f"final {monitor} | s to {monitor} {'<=' if mode == 'min' else '>='} {target} (CPU s, step) |",
             "|---|---|---|---|---|---|---|"]
    for name, v in table.items():
        if v["status"] != "ok":
            lines.append(f"| {name} | {v['status']}: {str(v.get('error'))[:120]} | | | | | |")
            continue
        ttt = (f"{v['time_to_target_s']:.1f} ({v['cpu_time_to_target_s']:.1f}, {v['target_step']:.0f})"
               if v["time_to_target_s"] is not None else "not reached")
        lines.append(f"| {name} | {v['throughput']['median']:,.0f} | {v['diff_pct']:+.1f} | {v['peak_rss_mib']:,.0f} | "
                     f"{v['final_train_loss']:.4f} | {v['final_val']:.4f} | {ttt} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--only", nargs="*", default=None, help="variant names to run (the baseline always runs)")
    args = parser.parse_args()
    load_start = os.getloadavg()
    results: dict[str, Any] = {"repeats": args.repeats, "common_overrides": COMMON, "workloads": {}}
    tables = []
    for workload in args.workloads:
        variants = list(WORKLOADS[workload]["variants"])
        baseline = variants[0]
        if args.only:
            variants = [baseline] + [v for v in variants[1:] if v in args.only]
        reasons = {v: available(overrides_for(workload, v)) for v in variants}
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
        for r in range(args.repeats):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for v in order:
                out = run(overrides_for(workload, v)) if reasons[v] is None else {"status": "unavailable",
                                                                                  "error": reasons[v]}
                runs[v].append(out)
                print(f"{workload} repeat {r} {v}: {out}", flush=True)
        table = {v: summarise(runs[v], runs[baseline]) if reasons[v] is None
                 else {"status": "unavailable", "error": reasons[v]} for v in variants}
        results["workloads"][workload] = {"base_overrides": WORKLOADS[workload]["base"],
                                          "target": WORKLOADS[workload]["target"],
                                          "variants": {v: {"overrides": WORKLOADS[workload]["variants"][v], **table[v]}
                                                       for v in variants}, "runs": runs}
        tables.append(markdown(workload, table))
    results["load_average_start_end"] = [load_start, os.getloadavg()]
    text = "\n\n".join(tables)
    results["markdown"] = text
    print(text)
    line = "; ".join(f"{w}: " + ", ".join(f"{v} {d['diff_pct']:+.0f}%" for v, d in results["workloads"][w]["variants"].items()
                                          if d.get("status") == "ok" and d.get("diff_pct") is not None)
                     for w in args.workloads)
    write_result("ablation_" + "_".join(args.workloads), results, f"throughput vs fp32 baseline ({args.repeats} repeat(s)): {line}; "
                                      f"load avg {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
