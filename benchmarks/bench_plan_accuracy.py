"""Is ``scripts/plan.py`` within 15% of the peak RSS the run then has? (issue 50, item 3)

    python benchmarks/bench_plan_accuracy.py                      # every case (model folders built on demand)
    python benchmarks/bench_plan_accuracy.py --cases finetune_1b_lora --tag xa

For each case, the commands the README shows, as a user runs them: ``scripts/plan.py <overrides> --json`` (its
configured row, ``*``: the predicted peak RSS, and plan.py's own wall time and peak RSS), then ``scripts/train.py
<overrides> trainer.max_steps=2`` in a fresh process under ``/usr/bin/time -v`` (the run's peak RSS: sanity check,
steps, final validation and the merged export included). The ratio predicted / measured is the target (0.85-1.15);
where glibc keeps freed memory (keep_freed_memory, a Hugging Face run's default) plan.py's bound of it is recorded.
Cases run one after the other with nothing else on the machine (load average recorded before and after each).
Result: ``benchmarks/results/plan_accuracy[_<tag>].json`` and a dated line in ``LOG.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, machine, write_result  # noqa: E402
from model_folders import build  # noqa: E402

#: name -> (model folder the case needs, train.py/plan.py overrides): the README's commands for Hugging Face folders
CASES = {
    "finetune_1b_lora": ("llama-3.2-1b", ["experiment=finetune_1b_lora"]),
    "finetune_1b_lora_int8": ("llama-3.2-1b", ["experiment=finetune_1b_lora", "peft.base_dtype=int8"]),
    "finetune_1b_lora_keep": ("llama-3.2-1b", ["experiment=finetune_1b_lora",
                                               "callbacks=[default,chunked_loss,keep_freed_memory]"]),
    "sft_lora": ("qwen2.5-0.5b", ["experiment=sft_lora"]),
    "lora05_default": ("qwen2.5-0.5b", ["model=hf_causal_lm", "data=text_folder", "peft=lora",
                                        "model.pretrained=${paths.cache_dir}/model_folders/qwen2.5-0.5b",
                                        "data.root=lightning"]),
}
TARGET = 0.15


def timed(command: list[str], log: Path) -> dict:
    """Run ``command`` under ``/usr/bin/time -v``: exit code, wall seconds, peak RSS (GiB), the load around it."""
    load = os.getloadavg()[0]
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.run(["/usr/bin/time", "-v", *command], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                              env={**os.environ, "DS_ACCELERATOR": "cpu"})
    text = log.read_text()
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    return {"rc": proc.returncode, "wall_s": round(time.perf_counter() - start, 1),
            "peak_rss_gib": round(int(rss.group(1)) / 2**20, 3) if rss else None,
            "load_before": round(load, 2), "load_after": round(os.getloadavg()[0], 2)}


def run_case(name: str, steps: int, work: Path) -> dict:
    folder, overrides = CASES[name]
    build(folder)
    plan_json = work / f"{name}.plan.json"
    plan = timed([sys.executable, "scripts/plan.py", *overrides, "--json", str(plan_json)], work / f"{name}.plan.log")
    row = json.loads(plan_json.read_text())["rows"][0] if plan_json.exists() else {}
    train = timed([sys.executable, "scripts/train.py", *overrides, f"trainer.max_steps={steps}",
                   f"hydra.run.dir={work / name}"], work / f"{name}.train.log")
    predicted = round(row["peak"] / 2**30, 3) if row else None
    kept = round(row["kept_peak"] / 2**30, 3) if row else None  # glibc's kept memory (keep_freed_memory): a bound
    measured = train["peak_rss_gib"]
    ratio = round(predicted / measured, 3) if predicted and measured and train["rc"] == 0 else None
    parts = {k: round(v / 2**30, 3) for k, v in row.items() if isinstance(v, int) and k not in ("row", "fits")}
    print(f"{name}: predicted {predicted} GiB (kept-memory bound {kept}), measured {measured} GiB, x{ratio} "
          f"(plan.py {plan['wall_s']} s, {plan['peak_rss_gib']} GiB; train {train['wall_s']} s, rc {train['rc']})",
          flush=True)
    return {"overrides": overrides, "steps": steps, "predicted_gib": predicted, "kept_bound_gib": kept,
            "keeps_freed_memory": bool(row) and row["kept_peak"] > row["peak"], "measured_gib": measured,
            "ratio": ratio, "within_target": ratio is not None and abs(ratio - 1) <= TARGET,
            "below_kept_bound": measured is not None and kept is not None and measured <= kept, "parts_gib": parts,
            "plan": plan, "train": train}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--steps", type=int, default=2, help="trainer.max_steps of each run")
    parser.add_argument("--tag", default="", help="suffix of the result's name")
    args = parser.parse_args()
    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}: choose from {', '.join(CASES)}")
    print(f"CPU: {machine().get('cpu')}", flush=True)
    with tempfile.TemporaryDirectory(prefix="plan_accuracy_") as tmp:
        results = {name: run_case(name, args.steps, Path(tmp)) for name in names}
    line = "; ".join(f"{n}: plan.py {r['predicted_gib']} GiB vs peak RSS {r['measured_gib']} GiB (x{r['ratio']}"
                     + (f", glibc keeps freed memory: bound {r['kept_bound_gib']} GiB)" if r["keeps_freed_memory"]
                        else ")") for n, r in results.items())
    met = sum(r["within_target"] for r in results.values())
    write_result("plan_accuracy" + (f"_{args.tag}" if args.tag else ""), results,
                 f"scripts/plan.py's configured row vs the run's peak RSS (/usr/bin/time -v), {args.steps} steps: "
                 f"{line}; {met}/{len(results)} within 15%")


if __name__ == "__main__":
    main()
