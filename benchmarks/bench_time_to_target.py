"""Time from process launch to charlm val/loss <= 1.80: lit_speed's preset vs plain Lightning vs a plain loop.

    python benchmarks/bench_time_to_target.py                          # the race: 4 variants x 3 seeds
    python benchmarks/bench_time_to_target.py --steps 60 --seeds 1 --variants plain_loop,lit_speed \\
        --every-tokens 7680 --target 3.0                              # smoke mode: no JSON/LOG/PNG written

Same GPT (4 layers, 4 heads, 128 embd, block 64) and corpus in every variant, each a fresh process,
interleaved over seeds (the variant order rotates per seed):

- ``lit_speed``: ``scripts/train.py experiment=charlm_fast`` (the preset, one command, its own horizon).
- ``lit_speed_fp32``: the same preset forced onto the fp32 path a CPU without bf16 units takes
  (``precision=32-true optimizer.ns_dtype=float32``): what the preset is worth there, measured on any CPU.
- ``plain_lightning``: a plain LightningModule, AdamW lr 1e-3 constant, betas 0.9/0.99, wd 0.1, batch 12,
  fp32, ``Trainer`` defaults (checkpointing, logger, progress bar), no lit_speed component.
- ``plain_lightning_same_recipe``: plain Lightning with charlm_fast's micro-batch, AdamW LR and LR schedule
  (read from its YAML) but none of lit_speed's components: what the components add beyond tuning.
- ``plain_loop``: benchmarks/plain_loop.py with the plain_lightning recipe, no framework.
- ``foreign_plain`` / ``foreign_lit_speed``: a user's own GPT LightningModule (``benchmarks/foreign_gpt.py``, not
  ``lit_speed.models``, same size) in plain Lightning with the plain_lightning recipe, and the same module with the
  preset's levers plugged in by hand (GuardedPrecision, AccumulationScheduler, MuonAdamW + WSD; values read
  from the preset's YAML): does the win travel to a model lit_speed did not write?

The instrument is identical in every variant (:class:`lit_speed.reporting.FixedValidationClock`): the same
512 evenly spaced validation windows, every ``--every-tokens`` training tokens (76,800 = 100 steps at
batch 12), Lightning's own validation off; the clock starts at process launch (imports, data, compile,
validation and checkpoints count). A run stops at the first validation <= target; one that does not get
there within its budget reports its best value and "not reached". Every lit_speed run starts from an empty
machine cache (its own ``LIT_SPEED_CACHE_DIR``), so the timing of its measured choices is in its clock, as on a
user's first run; ``--warm-cache`` uses the machine's cache instead.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import _common  # noqa: F401 - puts the repository on sys.path
from _common import ROOT, stats, write_result

CACHE = str(ROOT / ".cache" / "charlm")
VARIANTS = ("lit_speed", "lit_speed_fp32", "plain_lightning", "plain_lightning_same_recipe", "plain_loop",
            "foreign_lit_speed", "foreign_plain")
DEFAULT_VARIANTS = ("lit_speed", "lit_speed_fp32", "plain_lightning", "plain_lightning_same_recipe", "plain_loop")
PLAIN_RECIPE = {"batch_size": 12, "lr": 1e-3, "schedule": None}
#: The overrides that put the preset on the path a CPU without bf16 units takes (``lit_speed_fp32``).
FP32_PATH = ("precision=32-true", "optimizer.ns_dtype=float32")
#: Child variants (a function of this file); the lit_speed ones are ``scripts/train.py`` commands.
CHILDREN = tuple(v for v in VARIANTS if not v.startswith("lit_speed"))


def preset_recipe() -> dict[str, Any]:
    """charlm_fast's micro-batch, AdamW LR and LR schedule (from its YAML, so they cannot drift)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=charlm_fast"])
    sched = cfg.model.get("scheduler")
    lr = cfg.optimizer.get("adamw_lr", cfg.optimizer.lr)  # muon keeps AdamW's LR for embeddings/head apart
    return {"batch_size": int(cfg.data.batch_size), "lr": float(lr), "max_steps": int(cfg.trainer.max_steps),
            "schedule": None if sched is None else {k: v for k, v in sched.items() if k != "_partial_"}}


def child_lightning(seed: int, steps: int, target: float, every_tokens: int, out: str, recipe: dict[str, Any]) -> None:
    """A plain LightningModule around the same GPT: no lit_speed component but the instrument."""
    import hydra
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F

    from lit_speed.data.charlm import CharLMDataModule
    from lit_speed.models.configure_optimizers import param_groups
    from lit_speed.models.gpt import GPT
    from lit_speed.reporting.fixed_validation import FixedValidationClock

    class PlainGPT(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = GPT(97, 64, 4, 4, 128)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            logits = self(x)
            return F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(param_groups(self.model, 0.1), lr=recipe["lr"], betas=(0.9, 0.99))
            if recipe["schedule"] is None:
                return opt
            sched = hydra.utils.instantiate({**recipe["schedule"], "_partial_": True})(
                opt, total_steps=recipe.get("max_steps", steps))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    pl.seed_everything(seed)
    dm = CharLMDataModule(cache_dir=CACHE, block_size=64, batch_size=recipe["batch_size"])
    clock = FixedValidationClock(target=target, every_tokens=every_tokens, out_path=out)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, limit_val_batches=0,
                             callbacks=[clock], default_root_dir=tmp)
        trainer.fit(PlainGPT(), datamodule=dm)


def child_foreign(name: str, seed: int, steps: int, target: float, every_tokens: int, out: str) -> None:
    """The user's own GPT module, plain (``foreign_plain``) or with the preset's levers (``foreign_lit_speed``)."""
    import foreign_gpt
    import lightning.pytorch as pl

    from lit_speed.data.charlm import CharLMDataModule
    from lit_speed.reporting.fixed_validation import FixedValidationClock

    levers = foreign_gpt.preset_levers(str(ROOT)) if name == "foreign_lit_speed" else None
    make_optimizer, plugins, callbacks = (foreign_gpt.lit_speed_parts(levers) if levers is not None
                                          else foreign_gpt.plain_parts(PLAIN_RECIPE["lr"]))
    pl.seed_everything(seed)
    dm = CharLMDataModule(cache_dir=CACHE, block_size=64,
                          batch_size=levers["batch_size"] if levers else PLAIN_RECIPE["batch_size"])
    clock = FixedValidationClock(target=target, every_tokens=every_tokens, out_path=out)
    model = foreign_gpt.UserGPT(97, 64, make_optimizer)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, limit_val_batches=0, plugins=plugins,
                             callbacks=[*callbacks, clock], default_root_dir=tmp)
        trainer.fit(model, datamodule=dm)


def child_plain_loop(seed: int, steps: int, target: float, every_tokens: int, out: str) -> None:
    import plain_loop

    from lit_speed.reporting.fixed_validation import TokenCadenceProbe

    probe = TokenCadenceProbe(None, every_tokens, target)
    cfg = plain_loop.LoopConfig(max_steps=steps, val_every=0, seed=seed, cache_dir=CACHE, lr=PLAIN_RECIPE["lr"],
                                batch_size=PLAIN_RECIPE["batch_size"], constant_lr=True)
    plain_loop.train(cfg, probe=probe)
    Path(out).write_text(json.dumps(probe.summary()))


def lit_speed_command(seed: int, steps: int | None, target: float, every_tokens: int, out: str,
                      run_dir: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The preset as a user runs it (plus ``extra`` overrides), the shared instrument, Lightning's validation off."""
    cmd = [sys.executable, "scripts/train.py", "experiment=charlm_fast", *extra, f"seed={seed}", "validate=false",
           "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false",
           "+callbacks.clock._target_=lit_speed.reporting.fixed_validation.FixedValidationClock",
           f"+callbacks.clock.target={target}", f"+callbacks.clock.every_tokens={every_tokens}",
           f"+callbacks.clock.out_path={out}", f"hydra.run.dir={run_dir}"]
    return cmd + ([f"trainer.max_steps={steps}"] if steps is not None else [])


def run_variant(name: str, seed: int, steps: int | None, target: float, every_tokens: int,
                warm_cache: bool = False) -> dict[str, Any]:
    """One fresh process; returns the instrument's summary (history of val loss vs wall seconds)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "clock.json")
        env = dict(os.environ)
        if name.startswith("lit_speed"):
            cmd = lit_speed_command(seed, steps, target, every_tokens, out, tmp,
                                    FP32_PATH if name == "lit_speed_fp32" else ())
            if not warm_cache:
                env["LIT_SPEED_CACHE_DIR"] = str(Path(tmp) / "machine_cache")
        else:
            cmd = [sys.executable, __file__, "--child", name, "--seed", str(seed), "--target", str(target),
                   "--every-tokens", str(every_tokens), "--out", out, "--steps", str(steps or 3000)]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        if proc.returncode != 0 or not Path(out).exists():
            raise RuntimeError(f"{name} (seed {seed}) failed:\n{proc.stderr[-3000:]}")
        result = json.loads(Path(out).read_text())
        if name.startswith("lit_speed"):  # what this run measured and chose (the choices differ run to run)
            result["choices"] = measured_choices(proc.stdout + proc.stderr)
        return result


#: the log lines of the preset's measured choices (``GuardedPrecision: precision=auto -> 32-true (timed ...)``)
CHOICE_LINE = re.compile(r"^(?:GuardedPrecision|Muon|MuonAdamW): \S+ -> .*$", re.MULTILINE)


def measured_choices(output: str) -> list[str]:
    """The measured-choice lines a lit_speed run printed, in order."""
    return CHOICE_LINE.findall(output)


def first_reaching(out: dict[str, Any], target: float) -> dict[str, Any] | None:
    """The first validation of a run at or below ``target`` (its wall seconds, step, tokens), or None."""
    return next((h for h in out["history"] if h["val_loss"] <= target), None)


def summarize(runs: dict[str, list[dict[str, Any]]], target: float) -> dict[str, Any]:
    """Median and spread of time/steps/tokens to ``target`` per variant (over the runs that reached it)."""
    summary: dict[str, Any] = {}
    for name, outs in runs.items():
        hits = [h for h in (first_reaching(o, target) for o in outs) if h is not None]
        summary[name] = {"reached": f"{len(hits)}/{len(outs)}",
                         "time_to_target_s": stats([h["wall_s"] for h in hits]) if hits else None,
                         "steps_to_target": stats([h["step"] for h in hits]) if hits else None,
                         "tokens_to_target": stats([h["tokens"] for h in hits]) if hits else None,
                         "best_val_loss": min((o["best_val_loss"] for o in outs if o["best_val_loss"] is not None),
                                              default=None)}
    return summary


def ratio(summary: dict[str, Any], a: str, b: str) -> float | None:
    ta, tb = summary.get(a, {}).get("time_to_target_s"), summary.get(b, {}).get("time_to_target_s")
    return round(ta["median"] / tb["median"], 3) if ta and tb else None


def cpu_details() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"torch_threads": torch.get_num_threads(),
                            "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    try:
        flags = next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags"))
        info["cpu_flags"] = flags.split(":", 1)[1].split()
    except (OSError, StopIteration):
        info["cpu_flags"] = []
    return info


def plot(runs: dict[str, list[dict[str, Any]]], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, outs) in enumerate(runs.items()):
        for j, out in enumerate(outs):
            hist = out["history"]
            ax.plot([h["wall_s"] for h in hist], [h["val_loss"] for h in hist], color=f"C{i}", alpha=0.8,
                    label=name if j == 0 else None)
    ax.axhline(target, color="k", linestyle="--", linewidth=0.8)
    ax.set_xlabel("wall seconds since process launch")
    ax.set_ylabel("val/loss (512 fixed windows)")
    ax.set_ylim(top=min(3.0, ax.get_ylim()[1]))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, default=1.80)
    parser.add_argument("--lower-targets", default="1.75,1.70,1.65",
                        help="lower val/loss targets each run goes on to (within its budget): is a variant still ahead "
                             "at every target the plain run reaches?")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None,
                        help="step budget of every variant (default: 3000 for the references, the preset's own "
                             "horizon for lit_speed); setting it is smoke mode: nothing is written")
    parser.add_argument("--every-tokens", type=int, default=76_800)
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated, from {', '.join(VARIANTS)}")
    parser.add_argument("--child", choices=CHILDREN, default=None)
    parser.add_argument("--warm-cache", action="store_true",
                        help="lit_speed runs use the machine's cache of measured choices (default: an empty one each)")
    parser.add_argument("--tag", default="", help="suffix of the JSON/PNG names (e.g. _xa_fp32)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.child:
        if args.child == "plain_loop":
            child_plain_loop(args.seed, args.steps, args.target, args.every_tokens, args.out)
        elif args.child.startswith("foreign_"):
            child_foreign(args.child, args.seed, args.steps, args.target, args.every_tokens, args.out)
        else:
            recipe = preset_recipe() if args.child == "plain_lightning_same_recipe" else PLAIN_RECIPE
            child_lightning(args.seed, args.steps, args.target, args.every_tokens, args.out, recipe)
        return
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = set(names) - set(VARIANTS)
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    load_start = os.getloadavg()
    lower = sorted((float(t) for t in args.lower_targets.split(",") if t.strip()), reverse=True)
    stop_at = min([args.target, *lower])
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for s in range(args.seeds):
        seed = 42 + s
        for name in names[s % len(names):] + names[:s % len(names)]:
            out = run_variant(name, seed, args.steps, stop_at, args.every_tokens, args.warm_cache)
            runs[name].append(out)
            hit = first_reaching(out, args.target)
            print(f"seed {seed} {name:28s} {args.target}: t={hit and hit['wall_s']} step={hit and hit['step']} "
                  f"best={out['best_val_loss']:.4f}", flush=True)
    summary = summarize(runs, args.target)
    at_lower = {f"{t:.2f}": summarize(runs, t) for t in lower}
    ahead = {t: {name: ratio(s_, name, base) for name, base in (("lit_speed", "plain_lightning"),
                                                                ("lit_speed_fp32", "plain_lightning"),
                                                                ("foreign_lit_speed", "foreign_plain"))}
             for t, s_ in at_lower.items()}
    ratios = {"lit_speed/plain_lightning": ratio(summary, "lit_speed", "plain_lightning"),
              "lit_speed_fp32/plain_lightning": ratio(summary, "lit_speed_fp32", "plain_lightning"),
              "lit_speed/plain_lightning_same_recipe": ratio(summary, "lit_speed", "plain_lightning_same_recipe"),
              "plain_lightning_same_recipe/plain_lightning": ratio(summary, "plain_lightning_same_recipe",
                                                                   "plain_lightning"),
              "plain_loop/plain_lightning": ratio(summary, "plain_loop", "plain_lightning"),
              "foreign_lit_speed/foreign_plain": ratio(summary, "foreign_lit_speed", "foreign_plain")}
    for name in names:
        t, st = summary[name]["time_to_target_s"], summary[name]["steps_to_target"]
        print(f"{name:28s} reached {summary[name]['reached']}: " + (
            f"{t['median']:.1f} s (min {t['min']:.1f}, max {t['max']:.1f}), {st['median']:.0f} steps"
            if t else f"not reached (best {summary[name]['best_val_loss']})"))
    print(f"ratios (median time to {args.target}): {ratios}  (goal: lit_speed/plain_lightning <= 0.33, "
          f"foreign_lit_speed/foreign_plain <= 0.5)")
    print(f"ratios at the lower targets (None: a side did not reach it): {ahead}")
    if args.steps is not None:
        print("smoke mode (--steps given): no JSON, LOG.md line or PNG written")
        return
    results = {"target_val_loss": args.target, "seeds": args.seeds, "every_tokens": args.every_tokens,
               "reference_budget_steps": 3000, "preset": preset_recipe(), "summary": summary, "ratios": ratios,
               "lower_targets": {"summary": at_lower, "ratios": ahead},
               "runs": runs, "cpu": cpu_details(), "load_average_start_end": [load_start, os.getloadavg()],
               "machine_cache": "warm" if args.warm_cache else "empty per lit_speed run"}
    png = ROOT / "benchmarks" / "results" / f"time_to_target{args.tag}.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    plot(runs, args.target, png)
    write_result(f"time_to_target{args.tag}", results,
                 f"charlm val/loss <= {args.target}, clock from launch, {args.seeds} seeds, "
                 f"{results['machine_cache']} machine cache: charlm_fast / plain "
                 f"Lightning = x{ratios['lit_speed/plain_lightning']}, fp32 path / plain = "
                 f"x{ratios['lit_speed_fp32/plain_lightning']}, / same recipe = "
                 f"x{ratios['lit_speed/plain_lightning_same_recipe']}, plain loop / Lightning = "
                 f"x{ratios['plain_loop/plain_lightning']}, foreign module with lit_speed / plain = "
                 f"x{ratios['foreign_lit_speed/foreign_plain']}; at {', '.join(ahead)}: {ahead}; load avg "
                 f"{os.getloadavg()[0]:.1f}; PNG {png.name}")


if __name__ == "__main__":
    main()
