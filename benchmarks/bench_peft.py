"""Fine-tuning: full vs LoRA (several ranks) vs frozen-all-but-head, same start, same data, same wall budget.

    python benchmarks/bench_peft.py                         # GPT and HF, ranks 4,16,64, 120 s per run, 2 repeats
    python benchmarks/bench_peft.py --models gpt --budget-s 60 --repeats 1
    python benchmarks/bench_peft.py --smoke                 # tiny models, 4 s per run: checks the plumbing only

Two workloads, each started from the same pretrained weights and fine-tuned on a shifted corpus (the installed
Lightning package's source, as ``experiment=charlm_finetune``):

- ``gpt``: the bundled charlm GPT (4L/4H/128), pretrained once on the standard library (the preset's ``init``);
- ``hf``: a small Hugging Face Llama built locally (4 layers, 128 wide, a BPE tokenizer trained on stdlib files),
  pretrained once on the standard library through ``model=hf_causal_lm data=text_folder``.

Each variant runs ``scripts/train.py`` in a fresh process (so peak RSS is its own) for the same wall budget
(``trainer.max_time``), validating every ``--val-every`` steps; a recorder callback (``peft_recorder.py``) writes
trainable/total parameters, optimizer-state bytes (the optimizer's state tensors), gradient bytes (gradients the
optimizer holds), peak RSS (``ru_maxrss``), median step time after warm-up, and the (wall s, step, val/loss) curve.
Variants run interleaved, round-robin per repeat, so machine noise hits them alike; ratios are against full
fine-tuning in the same round. LRs differ by variant (stated in the JSON): adapters start at zero and want more.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, write_result  # noqa: E402

HERE = Path(__file__).resolve().parent
CACHE = ROOT / ".cache" / "bench_peft"
QUIET = ["logger=none", "validate=false", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
         "trainer.num_sanity_val_steps=0", "callbacks=none"]


def variants(ranks: list[int], lr_full: float, lr_adapter: float) -> dict[str, list[str]]:
    """name -> the overrides that select it (peft option, rank, LR)."""
    out = {"full": ["peft=none", f"optimizer.lr={lr_full}"]}
    for r in ranks:
        out[f"lora_r{r}"] = ["peft=lora", f"peft.r={r}", f"peft.alpha={2 * r}", "peft.export=false",
                             f"optimizer.lr={lr_adapter}"]
    out["head_only"] = ["peft=head_only", "peft.export=false", f"optimizer.lr={lr_adapter}"]
    return out


def lightning_source() -> str:
    from lit_speed.data.charlm import source_root

    return str(source_root("lightning"))


def workload(name: str, smoke: bool, pretrain_steps: int) -> list[str]:
    """The overrides every variant of a workload shares: model, data, and the start (pretrained once, cached)."""
    if name == "gpt":
        sizes = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2"] if smoke else []
        pretrain = ["experiment=charlm_fast", f"trainer.max_steps={pretrain_steps}", "callbacks=[model_checkpoint]",
                    f"trainer.val_check_interval={min(100, pretrain_steps)}",
                    "logger=none", "validate=false", *sizes]
        start = CACHE / f"gpt{'_smoke' if smoke else ''}_pretrained.ckpt"
        return ["experiment=charlm_finetune", *sizes, f"init.path={start}",
                "init.pretrain=[" + ",".join(f"'{o}'" for o in pretrain) + "]"]
    from tests.helpers.tiny_hf import STDLIB, save_tiny_causal_lm

    folder = CACHE / f"hf_llama{'_smoke' if smoke else ''}"
    if not (folder / "config.json").exists():
        save_tiny_causal_lm(folder, "llama", seed=0, vocab_size=300 if smoke else 2000,
                            hidden=64 if smoke else 128, layers=2 if smoke else 4)
    data = ["model=hf_causal_lm", "data=text_folder", f"model.pretrained={folder}", "data.block_size=128",
            "data.batch_size=8", "trainer.max_epochs=-1", "trainer.check_val_every_n_epoch=null"]
    size = f"data.max_bytes={200_000 if smoke else 1_000_000}"
    pretrain = [*data, f"data.root={STDLIB}", size, f"trainer.max_steps={pretrain_steps}",
                f"trainer.val_check_interval={min(100, pretrain_steps)}",
                "callbacks=[model_checkpoint]", "logger=none", "validate=false", "optimizer.lr=0.002"]
    start = CACHE / f"hf{'_smoke' if smoke else ''}_pretrained.ckpt"
    return [*data, f"data.root={lightning_source()}", size, "init=weights", f"init.path={start}",
            "init.pretrain=[" + ",".join(f"'{o}'" for o in pretrain) + "]"]


def _dhms(seconds: float) -> str:
    """Lightning's ``max_time`` string ``DD:HH:MM:SS``."""
    s = int(seconds)
    return f"{s // 86400:02d}:{s // 3600 % 24:02d}:{s // 60 % 60:02d}:{s % 60:02d}"


def run_variant(base: list[str], extra: list[str], budget_s: float, val_every: int, horizon: int,
                out: Path, warmup_steps: int = 5) -> dict[str, Any]:
    """One fresh ``scripts/train.py`` run for ``budget_s`` wall seconds of fit; its recorder's JSON."""
    out.mkdir(parents=True, exist_ok=True)
    # the LR schedule spans `horizon` steps for every variant; the wall budget (max_time) ends the run first
    args = [*base, *extra, *QUIET, f"trainer.max_steps={horizon}", f"+trainer.max_time={_dhms(budget_s)}",
            f"trainer.val_check_interval={val_every}", "trainer.limit_val_batches=8",
            "+callbacks.bench._target_=peft_recorder.BenchRecorder", f"+callbacks.bench.out={out / 'bench.json'}",
            f"+callbacks.bench.warmup_steps={warmup_steps}",
            f"hydra.run.dir={out}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "DS_ACCELERATOR": "cpu", "HYDRA_FULL_ERROR": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    if done.returncode != 0 or not (out / "bench.json").exists():
        raise RuntimeError(f"variant {extra} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads((out / "bench.json").read_text())


def summarise(runs: list[dict[str, Any]], full: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repeats, and ratios against full fine-tuning of the same round."""
    def med(key: str, rs: list[dict[str, Any]] = runs) -> float | None:
        values = [r[key] for r in rs if r.get(key) is not None]
        return statistics.median(values) if values else None

    def ratio(key: str) -> float | None:
        mine, theirs = med(key), med(key, full)
        return None if mine is None or not theirs else mine / theirs

    final = [r["curve"][-1][2] for r in runs if r["curve"]]
    best = [min(c[2] for c in r["curve"]) for r in runs if r["curve"]]
    return {
        "trainable_params": runs[0]["trainable_params"], "total_params": runs[0]["total_params"],
        "optimizer_state_bytes": med("optimizer_state_bytes"), "grad_bytes": med("grad_bytes"),
        "peak_rss_bytes": med("peak_rss_bytes"), "step_time_ms": med("step_time_ms_median"), "steps": med("steps"),
        "val_loss_at_budget": statistics.median(final) if final else None,
        "best_val_loss": statistics.median(best) if best else None,
        "ratio_vs_full": {"optimizer_state": ratio("optimizer_state_bytes"), "grads": ratio("grad_bytes"),
                          "peak_rss": ratio("peak_rss_bytes"), "step_time": ratio("step_time_ms_median")},
        "curves": [r["curve"] for r in runs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt,hf", help="gpt, hf or both")
    parser.add_argument("--ranks", default="4,16,64", help="LoRA ranks")
    parser.add_argument("--budget-s", type=float, default=120.0, help="wall seconds of fit per run")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--val-every", type=int, default=50, help="validate every N optimizer steps")
    parser.add_argument("--horizon", type=int, default=3000, help="LR schedule length in steps (the budget ends first)")
    parser.add_argument("--pretrain-steps", type=int, default=450, help="steps of the (cached) pretraining run")
    parser.add_argument("--lr-full", type=float, default=5e-4)
    parser.add_argument("--lr-adapter", type=float, default=2e-3)
    parser.add_argument("--smoke", action="store_true", help="tiny models, 4 s runs, 1 repeat: plumbing only")
    args = parser.parse_args()
    if args.smoke:
        args.budget_s, args.repeats, args.val_every, args.pretrain_steps, args.ranks = 4, 1, 5, 10, "4"
        args.horizon = 200
    ranks = [int(r) for r in args.ranks.split(",")]
    chosen = variants(ranks, args.lr_full, args.lr_adapter)
    results: dict[str, Any] = {"budget_s": args.budget_s, "repeats": args.repeats, "ranks": ranks,
                               "lr": {"full": args.lr_full, "adapters": args.lr_adapter}, "smoke": args.smoke}
    lines = []
    for model in args.models.split(","):
        base = workload(model, args.smoke, args.pretrain_steps)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in chosen}
        for repeat in range(args.repeats):
            for i in range(len(chosen)):  # round-robin, the order rotating each repeat
                name = list(chosen)[(i + repeat) % len(chosen)]
                out = CACHE / "runs" / f"{model}_{name}_{repeat}"
                runs[name].append(run_variant(base, chosen[name], args.budget_s, args.val_every, args.horizon, out,
                                              0 if args.smoke else 5))
                print(f"{model} {name} repeat {repeat}: {runs[name][-1]['steps']} steps, "
                      f"val/loss {runs[name][-1]['curve'][-1][2] if runs[name][-1]['curve'] else 'n/a'}", flush=True)
        table = {name: summarise(rs, runs["full"]) for name, rs in runs.items()}
        results[model] = table
        fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
        cells = [f"{n} {t['trainable_params']:,} trainable, opt x{fmt(t['ratio_vs_full']['optimizer_state'])}, "
                 f"RSS x{fmt(t['ratio_vs_full']['peak_rss'])}, step x{fmt(t['ratio_vs_full']['step_time'])}, "
                 f"val {fmt(t['val_loss_at_budget'])}" for n, t in table.items()]
        lines.append(f"{model}: " + "; ".join(cells))
    if args.smoke:  # plumbing check: nothing is written where the real results go
        print(json.dumps(results, indent=1, default=str)[:4000])
        return
    write_result("peft", results, f"fine-tuning, {args.budget_s:g} s per run x {args.repeats}, ratios vs full: "
                 + " | ".join(lines))


if __name__ == "__main__":
    main()
