"""precision=auto's decision, measured apart from the machine's run-to-run noise (issue 15)

    python benchmarks/bench_auto_decision.py [--trials 20] [--reference-rounds 150] [--experiment charlm_fast]

``bench_precision_auto.py`` compares whole processes; on a shared VM their wall time spreads about +-10% from
run to run, so it cannot resolve a 5% difference in a few rounds. This script measures the two parts of
auto's cost in one process, where interleaving cancels the drift:

- **regret**: the preset's model and one real micro-batch (built from the experiment's config) are timed
  with auto's own interleaved timer (one forward+backward+optimizer step of each mode per round, rotating
  order) for ``--reference-rounds`` rounds, before and after the trials: the *reference* step time of each
  mode. Then ``--trials`` decisions are made exactly as a cold ``precision=auto`` run makes them (default
  budget, no cache). A decision's regret = reference time of the chosen mode / that of the fastest mode.
  The timer's step is forward+backward+fused AdamW; the preset's real step adds Muon and Lightning's loop,
  the same in every mode, so the regret of the real step is smaller than the one printed here.
- **overhead**: the seconds each decision took; a cold run pays it once per machine, model and batch, a run
  that finds the on-disk cache pays ~0.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, write_result  # noqa: E402


def model_and_batch(experiment: str):
    """The experiment's LightningModule and one training micro-batch, as the run would build them."""
    import hydra
    import lightning.pytorch as pl
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment={experiment}", "logger=none"])
    pl.seed_everything(cfg.seed)
    datamodule = hydra.utils.instantiate(cfg.data)  # as lit_speed.run.runner.build does, without the Trainer
    model = hydra.utils.instantiate(cfg.model, optimizer=hydra.utils.instantiate(cfg.optimizer))
    datamodule.prepare_data()
    datamodule.setup("fit")
    # the batch precision=auto times: the run's first training batch as the loader yields it
    return model, next(iter(datamodule.train_dataloader()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--reference-rounds", type=int, default=150)
    parser.add_argument("--experiment", default="charlm_fast")
    args = parser.parse_args()

    import torch

    from lit_speed.precision import modes, step_timing
    from lit_speed.tuning import machine_cache

    load_before = os.getloadavg()
    model, batch = model_and_batch(args.experiment)
    candidates = list(modes.TIMED_CANDIDATES)

    def reference() -> dict[str, float]:
        samples = step_timing._sample_interleaved(step_timing.detached_copy(model), batch, candidates,
                                                  args.reference_rounds, float("inf"), step_timing.loss_of)
        return {m: float(statistics.median(v)) for m, v in samples.items() if v}

    before = reference()
    print("reference before: " + ", ".join(f"{m} {1000 * t:.2f} ms" for m, t in before.items()), flush=True)
    trials = []
    for i in range(args.trials):
        machine_cache._IN_PROCESS.clear()  # timings kept in this process: each trial decides afresh
        start = time.perf_counter()
        times = step_timing.time_modes(model, batch, candidates, use_disk_cache=False)
        chosen, _ = step_timing.choose_by_timing(times)
        trials.append({"chosen": chosen, "seconds": round(time.perf_counter() - start, 3),
                       "times_ms": {m: round(1000 * t, 2) for m, t in times.items() if t is not None}})
        print(f"trial {i:2d}: {chosen:12s} in {trials[-1]['seconds']:.2f} s  {trials[-1]['times_ms']}", flush=True)
    after = reference()
    print("reference after:  " + ", ".join(f"{m} {1000 * t:.2f} ms" for m, t in after.items()), flush=True)
    load_after = os.getloadavg()

    ref = {m: (before[m] + after[m]) / 2 for m in before}
    fastest = min(ref, key=ref.get)
    regrets = [ref[t["chosen"]] / ref[fastest] for t in trials]
    seconds = [t["seconds"] for t in trials]
    choices = {m: sum(t["chosen"] == m for t in trials) for m in candidates}
    spread = {m: round(max(before[m], after[m]) / min(before[m], after[m]), 3) for m in before}
    print("\nreference (mean of before/after): " + ", ".join(f"{m} {1000 * t:.2f} ms (x{t / ref[fastest]:.3f})"
                                                           for m, t in ref.items()))
    print(f"decisions: {choices}; regret median x{statistics.median(regrets):.3f}, worst x{max(regrets):.3f} "
          f"(goal <= x1.05); decision time median {statistics.median(seconds):.2f} s, max {max(seconds):.2f} s")
    print(f"reference drift before/after: {spread}; load {load_before[0]:.2f} -> {load_after[0]:.2f}; "
          f"torch threads {torch.get_num_threads()}")
    results = {"args": vars(args), "reference_before_s": before, "reference_after_s": after, "fastest": fastest,
               "trials": trials, "regrets": regrets, "choices": choices, "load_before": load_before,
               "load_after": load_after}
    write_result("auto_decision", results,
                 f"precision=auto's decision on {args.experiment}'s model and micro-batch, {args.trials} cold trials vs "
                 f"a {args.reference_rounds}-round interleaved reference (before+after): fastest {fastest}; "
                 + ", ".join(f"{m} x{t / ref[fastest]:.3f}" for m, t in ref.items())
                 + f"; chosen {choices}; regret median x{statistics.median(regrets):.3f}, worst x{max(regrets):.3f}; "
                 f"decision {statistics.median(seconds):.2f} s median (cold run only); load {load_before[0]:.1f} -> "
                 f"{load_after[0]:.1f}")


if __name__ == "__main__":
    main()
