"""Steps and time to a target quality, with and without a curriculum, same seed.

    python benchmarks/bench_curriculum.py [--seeds 0 1 2] [--skip-charlm] [--charlm-target 2.9]

- digits: the default MLP (AdamW lr 1e-3, batch 64) on ``DigitsDataModule`` (plain) vs
  ``CurriculumDataModule(difficulty="centroid", pacing="linear", start_fraction=0.3, pace_duration=60)``
  (the ``data=digits_curriculum`` option), validated every 5 steps; ``CurriculumEarlyStopping(stop_at=0.95)``
  records the first optimizer step and training seconds at which val/acc >= 0.95.
- charlm: the ``experiment=charlm_cpu`` GPT (4L/4H/128, block 64, batch 12, AdamW lr 3e-3, warm-up + cosine
  over ``--charlm-steps``) plain vs sequence-length warm-up 16 -> 64 over 150 batches (``data=charlm_curriculum``),
  validated every 25 steps on 4 x 64 windows; time to ``val/loss <= --charlm-target``.

Each (workload, seed) pair runs both variants back to back in this process, with the same model init and
order, one torch thread; the LOG line reports medians over seeds and how many seeds reached the target sooner, honestly.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from _common import ROOT, write_result  # noqa: E402

from lit_speed.curriculum import CurriculumDataModule, CurriculumEarlyStopping  # noqa: E402
from lit_speed.data.charlm import CharLMDataModule  # noqa: E402
from lit_speed.data.digits import DigitsDataModule  # noqa: E402
from lit_speed.models.gpt import GPTModule  # noqa: E402
from lit_speed.models.mlp import MLPClassifier  # noqa: E402
from lit_speed.optim.schedules import warmup_cosine  # noqa: E402


def fit(model, dm, stopper, max_steps, val_every, limit_val=1.0) -> dict:
    trainer = pl.Trainer(max_steps=max_steps, max_epochs=-1, val_check_interval=val_every,
                         check_val_every_n_epoch=None, limit_val_batches=limit_val, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[stopper], default_root_dir=tempfile.mkdtemp())
    trainer.fit(model, datamodule=dm)
    out = stopper.final_summary()
    out["steps_run"] = trainer.global_step
    return out


def digits_run(seed: int, curriculum: bool, target: float, max_steps: int) -> dict:
    pl.seed_everything(seed, workers=True)
    model = MLPClassifier(optimizer=partial(torch.optim.AdamW, lr=1e-3))
    base = DigitsDataModule(batch_size=64)
    dm = (CurriculumDataModule(base, difficulty="centroid", pacing="linear", start_fraction=0.3, pace_duration=60,
                               seed=seed) if curriculum else base)
    stopper = CurriculumEarlyStopping("val/acc", mode="max", patience=None, stop_at=target)
    return fit(model, dm, stopper, max_steps, val_every=5)


def charlm_run(seed: int, curriculum: bool, target: float, max_steps: int) -> dict:
    pl.seed_everything(seed, workers=True)
    model = GPTModule(block_size=64, n_layer=4, n_head=4, n_embd=128,
                      optimizer=partial(torch.optim.AdamW, lr=3e-3, betas=(0.9, 0.95)),
                      scheduler=partial(warmup_cosine, warmup_steps=20, min_lr_ratio=0.1))
    base = CharLMDataModule(cache_dir=str(ROOT / ".cache" / "charlm"), block_size=64, batch_size=12)
    dm = (CurriculumDataModule(base, pacing="none", seq_len_start=16, seq_len_warmup=150, seed=seed, drop_last=True)
          if curriculum else base)
    stopper = CurriculumEarlyStopping("val/loss", mode="min", patience=None, stop_at=target)
    return fit(model, dm, stopper, max_steps, val_every=25, limit_val=4)


def compare(name: str, run, seeds: list[int], target: float, max_steps: int) -> dict:
    rows = []
    for seed in seeds:
        plain, curr = run(seed, False, target, max_steps), run(seed, True, target, max_steps)
        rows.append({"seed": seed, "plain": plain, "curriculum": curr})
        print(f"{name} seed {seed}: plain target_step={plain['target_step']} ({plain['target_time_s']} s) | "
              f"curriculum target_step={curr['target_step']} ({curr['target_time_s']} s)")
    reached = [r for r in rows if r["plain"]["target_step"] and r["curriculum"]["target_step"]]
    sooner = sum(r["curriculum"]["target_step"] < r["plain"]["target_step"] for r in reached)
    med = lambda key, variant: statistics.median(r[variant][key] for r in reached) if reached else None  # noqa: E731
    summary = {"target": target, "seeds": seeds, "runs": rows, "both_reached": len(reached),
               "curriculum_fewer_steps": sooner,
               "median_target_step": {v: med("target_step", v) for v in ("plain", "curriculum")},
               "median_target_time_s": {v: med("target_time_s", v) for v in ("plain", "curriculum")}}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--digits-target", type=float, default=0.95)
    parser.add_argument("--charlm-target", type=float, default=2.9)
    parser.add_argument("--charlm-steps", type=int, default=300)
    parser.add_argument("--skip-charlm", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("PYTHONHASHSEED", "0")
    torch.set_num_threads(1)  # both variants alike; on a shared, oversubscribed machine 2 OpenMP threads thrash
    results = {"digits": compare("digits", digits_run, args.seeds, args.digits_target, 600)}
    if not args.skip_charlm:
        results["charlm"] = compare("charlm", charlm_run, args.seeds[:1], args.charlm_target, args.charlm_steps)
    results["config"] = vars(args)
    parts = []
    for name, unit in (("digits", "val/acc>="), ("charlm", "val/loss<=")):
        r = results.get(name)
        if r is None:
            continue
        s, t = r["median_target_step"], r["median_target_time_s"]
        parts.append(f"{name} {unit}{r['target']}: curriculum fewer steps on {r['curriculum_fewer_steps']}/"
                     f"{r['both_reached']} seeds, median steps {s['curriculum']} vs {s['plain']} plain, "
                     f"time {t['curriculum']} vs {t['plain']} s")
    write_result("curriculum", results, "; ".join(parts) + " (shared, loaded 2-core machine: times are noisy)")


if __name__ == "__main__":
    main()
