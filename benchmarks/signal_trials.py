"""SIGTERM to the main process of 2-process runs at random times: exit code, time to exit, and an exact resume.

    python benchmarks/signal_trials.py [--strategies ddp zero2] [--tries 10] [--slow-tries 2] [--deadline 20]
                                       [--steps 120] [--seed 0] [--cost-steps 200]

For each strategy (``trainer.devices=2 strategy=<s>``, Lightning's own launcher, digits + MLP, deterministic,
``callbacks.fault_tolerance.signal_deadline_s=<deadline>``, validation and a checkpoint every 5 batches):

1. one uninterrupted run of ``--steps`` optimizer steps (the reference);
2. ``--tries`` runs, each sent SIGTERM (to the main process only) at a time drawn uniformly from the reference's
   training phase (from 80% of the time to its first checkpoint, at step 5, to 85% of its wall time; a run that
   finished before its signal is drawn again, up to 3 times): the exit code must be 143, the seconds from the signal
   to the exit are recorded (polled every 50 ms) and must be within the deadline;
3. ``--slow-tries`` runs whose steps from a random step on take 10 minutes (tests/helpers/fault_scripts/
   slow_step.py), SIGTERMed 2 s into such a step: the deadline path (the last completed step is saved);
4. each stopped run resumed with ``ckpt_path=last`` into its folder: its final ``last.ckpt`` must be bitwise equal
   to the reference's (weights and optimizer state), and its ``metrics.csv`` equal on the deterministic columns.

``--cost-steps``: in one process, what the deadline's per-step snapshot costs: the time of the snapshot itself
(median per optimizer step) next to the median step time, digits MLP and the charlm GPT, deadline on vs off
interleaved. Writes ``benchmarks/results/signal_trials.json`` and a line in ``benchmarks/LOG.md``.
"""
from __future__ import annotations

import argparse
import csv
import functools
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common  # noqa: F401 - puts the repository on sys.path
from _common import ROOT, write_result

sys.path.insert(0, str(ROOT))
from tests.helpers.fault_scripts.compare_checkpoints import max_abs_differences  # noqa: E402

CSV_KEYS = ("epoch", "step", "train/acc", "train/loss", "val/acc", "val/loss", "lr-AdamW/pg1", "lr-AdamW/pg2")


def base_args(strategy: str, steps: int, deadline: float) -> list[str]:
    return ["trainer.devices=2", f"strategy={strategy}", "trainer.max_epochs=-1", f"trainer.max_steps={steps}",
            "trainer.val_check_interval=5", "trainer.deterministic=true", "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false", "validate=false", "seed=7",
            f"callbacks.fault_tolerance.signal_deadline_s={deadline:g}"]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu", "HYDRA_FULL_ERROR": "0"}


def launch(args: list[str], run: Path, suffix: str = ".log") -> tuple[subprocess.Popen, Any]:
    run.parent.mkdir(parents=True, exist_ok=True)
    log = open(run.with_suffix(suffix), "w")
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "train.py"), *args, f"hydra.run.dir={run}"],
                            cwd=ROOT, env=env(), stdout=log, stderr=subprocess.STDOUT)
    return proc, log


def run_to_end(args: list[str], run: Path, suffix: str = ".log") -> dict[str, Any]:
    start = time.monotonic()
    proc, log = launch(args, run, suffix)
    first_ckpt = None
    while proc.poll() is None:
        if first_ckpt is None and (run / "checkpoints" / "last.ckpt").exists():
            first_ckpt = time.monotonic() - start
        time.sleep(0.05)
    log.close()
    return {"rc": proc.returncode, "wall_s": time.monotonic() - start, "first_checkpoint_s": first_ckpt}


def stopped_run(args: list[str], run: Path, delay_s: float | None, slow_marker: bool) -> dict[str, Any]:
    """Launch, SIGTERM the main process after ``delay_s`` (or 2 s into the first slow step), time its exit."""
    start = time.monotonic()
    proc, log = launch(args, run)
    logfile = run.with_suffix(".log")
    if slow_marker:
        while proc.poll() is None and "slow step" not in logfile.read_text():
            time.sleep(0.1)
        time.sleep(2.0)
    else:
        while proc.poll() is None and time.monotonic() - start < delay_s:
            time.sleep(0.02)
    if proc.poll() is not None:
        log.close()
        return {"rc": proc.returncode, "signalled": False}
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    while proc.poll() is None and time.monotonic() - sent < 300:
        time.sleep(0.05)
    hung = proc.poll() is None
    if hung:
        subprocess.run(["pkill", "-9", "-f", f"hydra.run.dir={run}"], check=False)  # every rank of this trial
        proc.wait()
    log.close()
    time.sleep(1.0)
    leftover = subprocess.run(["pgrep", "-f", f"hydra.run.dir={run}"], capture_output=True, text=True).stdout.split()
    text = logfile.read_text()
    line = next((ln for ln in text.splitlines() if "interrupted at step" in ln or "deadline without saving" in ln), "")
    return {"rc": proc.returncode, "signalled": True, "signal_at_s": round(sent - start, 2),
            "exit_after_s": round(time.monotonic() - sent - 1.0, 2), "hung": hung, "leftover_processes": len(leftover),
            "deadline_path": "last completed step was saved" in line, "line": line[-300:]}


def csv_rows(path: Path) -> list[tuple]:
    if not path.exists():
        return []
    rows = []
    for row in csv.DictReader(path.open(newline="")):
        kept = tuple((k, row[k]) for k in CSV_KEYS if row.get(k))
        if any(k not in ("epoch", "step") for k, _ in kept):
            rows.append(kept)
    return rows


def trial(args: list[str], reference: Path, run: Path, delay_s: float | None, slow_from: int | None,
          deadline: float) -> dict[str, Any]:
    extra = [] if slow_from is None else [
        "+callbacks.slow._target_=tests.helpers.fault_scripts.slow_step.SlowStep", "+callbacks.slow.seconds=600",
        f"+callbacks.slow.from_step={slow_from}"]
    out = stopped_run(args + extra, run, delay_s, slow_from is not None)
    if out.get("signalled"):
        resumed = run_to_end(args + ["ckpt_path=last"], run, ".resume.log")
        out["resume_rc"] = resumed["rc"]
        try:
            diffs = max_abs_differences(reference / "checkpoints" / "last.ckpt", run / "checkpoints" / "last.ckpt")
            out["tensors"] = len(diffs)
            out["tensors_different"] = sum(d != 0.0 for d in diffs.values())
        except Exception as error:  # noqa: BLE001 - a failed comparison is a result, not a crash
            out["compare_error"] = repr(error)[:300]
        out["csv_equal"] = csv_rows(reference / "csv" / "metrics.csv") == csv_rows(run / "csv" / "metrics.csv")
    out["ok"] = bool(out.get("signalled") and out["rc"] == 143 and not out["hung"] and out["exit_after_s"] <= deadline
                     and out.get("resume_rc") == 0 and out.get("tensors_different") == 0)
    return out


# ---------------------------------------------------------------------------------------------- snapshot cost
def snapshot_cost(steps: int) -> dict[str, Any]:
    """Median snapshot time per optimizer step and median step time, deadline on and off, in one process."""
    import lightning.pytorch as pl
    import torch

    from lit_speed.checkpointing import FaultTolerance, signal_stop
    from lit_speed.data.charlm import CharLMDataModule
    from lit_speed.data.digits import DigitsDataModule
    from lit_speed.models.gpt import GPTModule
    from lit_speed.models.mlp import MLPClassifier

    class StepClock(pl.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, *args: Any) -> None:
            self.starts.append(time.perf_counter())

    snapshots: list[float] = []
    original = signal_stop.SignalStop.snapshot

    def timed(self: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return original(self)
        finally:
            snapshots.append(time.perf_counter() - t0)

    signal_stop.SignalStop.snapshot = timed
    adamw = functools.partial(torch.optim.AdamW, lr=1e-3)
    workloads = {
        "digits_mlp": (lambda: MLPClassifier(optimizer=adamw), lambda: DigitsDataModule(batch_size=64)),
        "charlm_gpt": (lambda: GPTModule(optimizer=adamw, block_size=64, n_layer=4, n_head=4, n_embd=128),
                       lambda: CharLMDataModule(cache_dir=str(ROOT / ".cache" / "charlm"), block_size=64,
                                                batch_size=12, max_bytes=400_000)),
    }
    out: dict[str, Any] = {}
    try:
        for name, (model_fn, data_fn) in workloads.items():
            per: dict[str, list[float]] = {"off": [], "on": []}
            snap_medians = []
            for rnd in range(2):
                for variant in (("off", "on") if rnd % 2 == 0 else ("on", "off")):
                    snapshots.clear()
                    clock = StepClock()
                    deadline = 30.0 if variant == "on" else None
                    with tempfile.TemporaryDirectory() as tmp:
                        torch.manual_seed(0)
                        trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
                                             enable_model_summary=False, enable_checkpointing=False,
                                             limit_val_batches=0, default_root_dir=tmp,
                                             callbacks=[FaultTolerance(signal_deadline_s=deadline), clock])
                        trainer.fit(model_fn(), datamodule=data_fn())
                    gaps = [b - a for a, b in zip(clock.starts[10:], clock.starts[11:])]
                    per[variant].append(statistics.median(gaps))
                    if variant == "on":
                        snap_medians.append(statistics.median(snapshots[5:]))
            step_off, step_on = statistics.median(per["off"]), statistics.median(per["on"])
            snap = statistics.median(snap_medians)
            out[name] = {"step_ms_off": round(1e3 * step_off, 3), "step_ms_on": round(1e3 * step_on, 3),
                         "snapshot_ms": round(1e3 * snap, 3), "snapshot_share": round(snap / step_off, 4),
                         "ratio_on_off": round(step_on / step_off, 3)}
    finally:
        signal_stop.SignalStop.snapshot = original
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", nargs="*", default=["ddp", "zero2"])
    parser.add_argument("--tries", type=int, default=10)
    parser.add_argument("--slow-tries", type=int, default=2)
    parser.add_argument("--deadline", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cost-steps", type=int, default=200, help="0 = skip the snapshot cost")
    parser.add_argument("--out", default=None, help="folder for the runs (default: a temporary one)")
    opts = parser.parse_args()
    rng = random.Random(opts.seed)
    folder = Path(opts.out or tempfile.mkdtemp(prefix="signal_trials_"))
    load_before = os.getloadavg()
    results: dict[str, Any] = {"deadline_s": opts.deadline, "steps": opts.steps, "folder": str(folder),
                               "load_before": load_before}
    for strategy in opts.strategies:
        args = base_args(strategy, opts.steps, opts.deadline)
        reference = folder / strategy / "reference"
        ref = run_to_end(args, reference)
        print(f"{strategy} reference: {ref}", flush=True)
        # from a little before the reference's first checkpoint (step 5: the first steps included) to 85% of its wall
        start = 0.8 * (ref["first_checkpoint_s"] or 0.3 * ref["wall_s"])
        trials = []
        for i in range(opts.tries):
            for attempt in range(1, 4):  # a run that ended before its signal is not a signal trial: draw again
                delay = rng.uniform(start, 0.85 * ref["wall_s"])
                shutil.rmtree(folder / strategy / f"try{i}", ignore_errors=True)
                out = trial(args, reference, folder / strategy / f"try{i}", delay, None, opts.deadline)
                out["attempt"] = attempt
                if out.get("signalled"):
                    break
            print(f"{strategy} try {i}: {out}", flush=True)
            trials.append(out)
        for i in range(opts.slow_tries):
            slow_from = rng.randint(10, opts.steps - 20)
            out = trial(args, reference, folder / strategy / f"slow{i}", None, slow_from, opts.deadline)
            out["slow_from_step"] = slow_from
            print(f"{strategy} slow {i}: {out}", flush=True)
            trials.append(out)
        results[strategy] = {"reference": ref, "trials": trials,
                             "ok": sum(t["ok"] for t in trials), "n": len(trials),
                             "exit_after_s": [t.get("exit_after_s") for t in trials]}
    results["load_after_trials"] = os.getloadavg()
    if opts.cost_steps:
        results["snapshot_cost"] = snapshot_cost(opts.cost_steps)
        results["load_after_cost"] = os.getloadavg()
    parts = []
    for strategy in opts.strategies:
        r = results[strategy]
        times = [t for t in r["exit_after_s"] if t is not None]
        csv_same = sum(bool(t.get("csv_equal")) for t in r["trials"])
        parts.append(f"{strategy}: {r['ok']}/{r['n']} ok (exit 143 within {opts.deadline:g} s, resume bitwise), "
                     f"signal->exit {min(times):.1f}-{max(times):.1f} s, metrics.csv equal {csv_same}/{r['n']}"
                     if times else f"{strategy}: no signal sent")
    cost = results.get("snapshot_cost", {})
    cost_text = "; ".join(f"{k} snapshot {v['snapshot_ms']} ms/step = {100 * v['snapshot_share']:.1f}% of "
                          f"{v['step_ms_off']} ms (on/off x{v['ratio_on_off']})" for k, v in cost.items())
    write_result("signal_trials", results,
                 f"SIGTERM to the main process of 2-process runs at random times ({opts.tries} + {opts.slow_tries} "
                 f"slow-step tries each, deadline {opts.deadline:g} s): " + "; ".join(parts)
                 + (f"; {cost_text}" if cost_text else "")
                 + f"; load {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
