"""Packed training beside TRL's packing: the held-out loss after the same steps, over seeds (issue 49's loss check).

    python benchmarks/bench_sft_curve.py                      # 0.5B dims, 20 steps of 8 examples, seeds 42 43
    python benchmarks/bench_sft_curve.py --seeds 42 --steps 4 --heldout-every 200 --tag _smoke

TRL's ``packing=True`` and lit_speed's packed layout fill their rows with different examples, so their per-step
losses are not paired (the unpacked case is: ``bench_sft.py --suite equivalence``). What has to agree is what the
training did to the model. Both tools train the same JSONL (the stdlib chat examples, one in ``--heldout-every``
held out), with the same LoRA, LR, clipping and steps as ``bench_sft.py --suite speed`` (no validation on either
side); each run's exported merged model is then scored by one function, :func:`heldout_loss`: mean cross-entropy
over the held-out conversations' response spans (the positions both tools train: TRL's ``{% generation %}`` mask),
the weights read in bf16 for every row alike. A seed changes the adapters' initialisation and the data order on both
sides, so the spread over seeds is the run-to-run noise the comparison is read against. JSON, PNG (training loss
against trained tokens), a LOG line.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import RESULTS, write_result  # noqa: E402
from bench_sft import (  # noqa: E402
    GENERATION_TEMPLATES,
    SPEED_ROWS,
    WORK,
    add_steady_rates,
    ensure_trl,
    row_command,
    rows_per_batch,
    run,
)
from model_folders import build  # noqa: E402

#: TRL's packing first (the reference), then lit_speed's rows (``bench_sft.SPEED_ROWS``' names)
ROWS = ("trl/packing", "lit_speed/default")


def split_examples(folder: Path, every: int) -> tuple[Path, list[list[dict[str, str]]]]:
    """``messages`` JSONL of the stdlib examples without every ``every``-th one, and the held-out conversations."""
    from lit_speed.sft.stdlib_examples import SYSTEM, stdlib_examples

    folder.mkdir(parents=True, exist_ok=True)
    train, heldout = folder / "train_split.jsonl", []
    with train.open("w") as f:
        for i, item in enumerate(stdlib_examples()):
            messages = [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": f"What does the Python {item['signature']} do?"},
                        {"role": "assistant", "content": item["doc"]}]
            if i % every == every // 2:
                heldout.append(messages)
            else:
                f.write(json.dumps({"messages": messages}) + "\n")
    return train, heldout


def heldout_loss(folder: Path, tokenizer_folder: Path, conversations: list[list[dict[str, str]]], template: str,
                 max_length: int, bf16: bool) -> dict[str, float]:
    """Mean cross-entropy per response token of the model in ``folder`` on ``conversations`` (each cut at
    ``max_length`` tokens): the positions the ``{% generation %}`` markers of ``template`` mark, predicted from the
    ones before. Weights read in bf16 and computed in float32 (bf16 autocast where ``bf16``), whatever the folder
    holds, so every row is scored alike."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).float().eval()
    total, count = 0.0, 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for messages in conversations:
            encoded = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                                    return_assistant_tokens_mask=True)
            ids = torch.tensor(encoded["input_ids"][:max_length])
            trained = torch.tensor(encoded["assistant_masks"][:max_length], dtype=torch.bool)[1:]
            logits = model(ids[None]).logits[0, :-1].float()
            total += float(F.cross_entropy(logits[trained], ids[1:][trained], reduction="sum"))
            count += int(trained.sum())
    del model
    return {"loss": total / max(count, 1), "tokens": count}


def picture(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in rows:
        if r.get("exit") == 0 and r.get("loss"):
            tokens = [sum(r["trained"][:i + 1]) for i in range(len(r["trained"]))]
            ax.plot(tokens, r["loss"], marker=".", label=f"{r['name']} seed {r['seed']}: held-out "
                                                         f"{r['heldout']['loss']:.4f}")
    ax.set_xlabel("trained (response) tokens")
    ax.set_ylabel("training loss per step")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> None:
    from real_size_peers import native_bf16

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 43])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--heldout-every", type=int, default=24, help="one example in this many is held out")
    parser.add_argument("--model", choices=sorted(GENERATION_TEMPLATES), default="qwen2.5-0.5b")
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=["trl/packing", *(
        name for name in SPEED_ROWS if name.startswith("lit_speed/"))], help="trl/packing and lit_speed rows")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the steady rate")
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)

    ensure_trl()
    model = build(args.model)
    data, heldout = split_examples(WORK / "curve_data", args.heldout_every)
    template = GENERATION_TEMPLATES[args.model]
    template_file = WORK / f"{args.model}_generation.jinja"
    template_file.write_text(template)
    bf16 = native_bf16()
    packed_rows = rows_per_batch(model, data, args)
    base = heldout_loss(model, model, heldout, template, args.max_length, bf16)
    print(f"untrained folder: held-out loss {base['loss']:.4f} over {base['tokens']} response tokens")
    rows = []
    for seed in args.seeds:
        for name in args.rows:
            out = WORK / "curve" / f"{name.replace('/', '_')}_{seed}"
            micro = packed_rows if name == "trl/packing" else args.micro
            tool = SPEED_ROWS[name][0]
            seeded = ("--seed", str(seed)) if tool == "trl" else (f"seed={seed}",)
            row = {**run(name, row_command(name, model, data, out, args, micro, bf16, template_file, seeded), out),
                   "seed": seed}
            if row["exit"] == 0:
                export = out / "row.export" if tool == "trl" else out / "merged" / "hf"
                row["heldout"] = heldout_loss(export, model, heldout, template, args.max_length, bf16)
                row["trained_total"] = sum(row["trained"])
                add_steady_rates(row, args.warmup)
                print(f"{name} seed {seed}: held-out loss {row['heldout']['loss']:.4f}, "
                      f"{row['trained_total']} trained tokens")
            rows.append(row)
    ok = [r for r in rows if r["exit"] == 0]
    by_tool = {name: [r for r in ok if r["name"] == name] for name in args.rows}
    summary = {name: {"heldout_loss": [round(r["heldout"]["loss"], 4) for r in rs],
                      "trained_tokens": [r["trained_total"] for r in rs],
                      "steady_trained_tokens_per_s": [r["steady_trained_tokens_per_s"] for r in rs],
                      "peak_rss_gib": [round(r["peak_rss_bytes"] / 2**30, 2) for r in rs],
                      "launch_to_end_s": [round(r["launch_to_end_s"], 1) for r in rs],
                      "last_train_loss": [round(r["loss"][-1], 4) for r in rs]} for name, rs in by_tool.items()}
    spread = {name: round(max(s["heldout_loss"]) - min(s["heldout_loss"]), 4) for name, s in summary.items()
              if s["heldout_loss"]}
    means = {name: sum(s["heldout_loss"]) / len(s["heldout_loss"]) for name, s in summary.items() if s["heldout_loss"]}
    gap = {name: round(mean - means["trl/packing"], 4) for name, mean in means.items()
           if name != "trl/packing" and "trl/packing" in means}
    ratios = {}  # per seed, each lit_speed row against TRL's packing row of the same seed
    for r in ok:
        trl = next((t for t in by_tool.get("trl/packing", []) if t["seed"] == r["seed"]), None)
        if trl is not None and r is not trl:
            ratios.setdefault(r["name"], []).append({
                "seed": r["seed"],
                "tokens_per_s": round(r["steady_trained_tokens_per_s"] / trl["steady_trained_tokens_per_s"], 3),
                "peak_rss": round(r["peak_rss_bytes"] / trl["peak_rss_bytes"], 3),
                "launch_to_end": round(r["launch_to_end_s"] / trl["launch_to_end_s"], 3)})
    picture(ok, RESULTS / f"sft_curve{args.tag}.png")
    line = "; ".join(f"{n}: held-out loss {s['heldout_loss']} after {s['trained_tokens']} trained tokens, "
                     f"{s['steady_trained_tokens_per_s']} trained tok/s, {s['peak_rss_gib']} GiB, "
                     f"{s['launch_to_end_s']} s to export" for n, s in summary.items())
    line += "; vs TRL per seed (tok/s, RSS, launch): " + "; ".join(
        f"{n} " + ", ".join(f"x{v['tokens_per_s']}/x{v['peak_rss']}/x{v['launch_to_end']}" for v in vs)
        for n, vs in ratios.items())
    write_result(f"sft_curve{args.tag}", {"rows": rows, "summary": summary, "ratios_vs_trl_packing": ratios,
                                          "untrained": base, "seed_spread": spread,
                                          "mean_gap_to_trl_packing": gap, "heldout_examples": len(heldout),
                                          "packed_rows_trl": packed_rows, "bf16": bf16, "settings": vars(args)},
                 f"{args.model} dims, LoRA r={args.r}, {args.steps} steps of {args.micro} examples packed, seeds "
                 f"{args.seeds}, {len(heldout)} held-out conversations ({base['tokens']} response tokens, untrained "
                 f"{base['loss']:.4f}), TRL packing beside lit_speed: {line}; mean held-out loss minus TRL's {gap}, "
                 f"spread over seeds {spread}")


if __name__ == "__main__":
    main()
