"""Instruction fine-tuning beside TRL's SFTTrainer: the same model folder, JSONL, LoRA and steps, in one run.

    python benchmarks/bench_sft.py --suite equivalence        # fp32, unpacked, the file's order: the same loss per step
    python benchmarks/bench_sft.py --suite speed [--rows ...] # trained tokens/s, peak RSS, launch to exported model

TRL is what a user with instruction data would otherwise pick; it is not a lit_speed dependency, so this script
installs it (``pip install trl``) when it is missing. Each row is its own process under ``/usr/bin/time -v`` (peak
RSS of the process; wall, user and system seconds), rows run one after another. lit_speed's rows are
``scripts/train.py`` as a user types it; TRL's are ``benchmarks/sft_peers.py``. Data: chat examples built from this
Python's standard library (``lit_speed.sft.stdlib_examples``: most a few hundred tokens, a long tail past the block),
as ``messages`` and as TRL's conversational prompt/completion. Model: the Qwen2.5-0.5B-dims folder with its chat
template (``benchmarks/model_folders.py``).

``equivalence``: per format, TRL (``assistant_only_loss`` with a copy of the folder's template marked with
``{% generation %}`` for ``messages``; the prompt/completion split for prompt/completion) and lit_speed
(``data.shuffle=false data.packing=false``, float32, no clipping, constant LR): the loss at every step and the
trained tokens counted on both sides. JSON + a LOG line.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import RESULTS, settle_disk, write_result  # noqa: E402
from bench_real_size import TIME_V, run_sampled, time_v  # noqa: E402
from model_folders import CHAT, build  # noqa: E402

WORK = ROOT / ".cache" / "bench_sft"
MODEL = "qwen2.5-0.5b"
#: the folder's Qwen2.5 template with TRL's {% generation %} markers around each response and what follows it
#: (the span lit_speed trains: the content, <|im_end|> and the newline), so TRL's assistant_only_loss masks the same
GENERATION_TEMPLATE = CHAT[MODEL][1].replace(
    "{%- for message in messages %}{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or "
    "message.role == 'assistant' %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' "
    "}}{%- endif %}",
    "{%- for message in messages %}{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- elif message.role == "
    "'assistant' %}{{- '<|im_start|>assistant\\n' }}{%- generation %}{{- message.content + '<|im_end|>' + '\\n' }}"
    "{%- endgeneration %}{%- endif %}")
assert "generation" in GENERATION_TEMPLATE, "the folder's template changed: mark its responses again"
#: the same for the Llama-3.2 folder: its response span is the trimmed content and <|eot_id|>
LLAMA_TURN = ("{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + "
              "'<|eot_id|>' }}")
LLAMA_GENERATION_TEMPLATE = CHAT["llama-3.2-1b"][1].replace(
    LLAMA_TURN, "{%- if message['role'] == 'assistant' %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}{%- else %}" + LLAMA_TURN
    + "{%- endif %}")
assert "generation" in LLAMA_GENERATION_TEMPLATE, "the folder's template changed: mark its responses again"
GENERATION_TEMPLATES = {MODEL: GENERATION_TEMPLATE, "llama-3.2-1b": LLAMA_GENERATION_TEMPLATE}


def ensure_trl() -> None:
    if importlib.util.find_spec("trl") is None:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "trl>=1,<2"], check=True)


def data_files(folder: Path) -> dict[str, Path]:
    """``messages`` and conversational prompt/completion JSONL of the stdlib examples."""
    from lit_speed.sft.stdlib_examples import SYSTEM, stdlib_examples

    folder.mkdir(parents=True, exist_ok=True)
    items = stdlib_examples()
    out = {"messages": folder / "messages.jsonl", "prompt_completion": folder / "prompt_completion.jsonl"}
    with out["messages"].open("w") as f:
        for item in items:
            question = f"What does the Python {item['signature']} do?"
            f.write(json.dumps({"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question},
                                             {"role": "assistant", "content": item["doc"]}]}) + "\n")
    with out["prompt_completion"].open("w") as f:
        for item in items:
            question = f"What does the Python {item['signature']} do?"
            f.write(json.dumps({"prompt": [{"role": "user", "content": question}],
                                "completion": [{"role": "assistant", "content": item["doc"]}]}) + "\n")
    return out


def lit_command(model: Path, data: Path, out: Path, steps: int, micro: int, max_length: int, r: int, lr: float,
                extra: list[str]) -> list[str]:
    return [sys.executable, str(ROOT / "scripts" / "train.py"), "experiment=sft_lora", f"model.pretrained={model}",
            f"data.source={data}", f"data.max_length={max_length}", f"data.batch_size={micro}",
            f"trainer.max_steps={steps}", f"peft.r={r}", f"peft.alpha={2 * r}", f"optimizer.lr={lr}",
            "optimizer.betas=[0.9,0.99]", "model.scheduler=null", "trainer.log_every_n_steps=1", "logger=none",
            "trainer.enable_progress_bar=false", f"hydra.run.dir={out}", f"peft.export_dir={out}/merged",
            f"data.cache_dir={WORK / 'lit_cache'}",
            "+callbacks.bench._target_=real_size_recorder.StepRecorder", f"+callbacks.bench.out={out}/steps.json",
            *extra]


def trl_command(model: Path, data: Path, out: Path, steps: int, micro: int, max_length: int, r: int, lr: float,
                extra: list[str]) -> list[str]:
    return [sys.executable, str(ROOT / "benchmarks" / "sft_peers.py"), "--model", str(model), "--data", str(data),
            "--steps", str(steps), "--micro", str(micro), "--max-length", str(max_length), "--r", str(r),
            "--lr", str(lr), "--out", str(out / "row.json"), *extra]


def run(name: str, cmd: list[str], out: Path) -> dict[str, Any]:
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    path = os.pathsep.join(p for p in (str(ROOT / "benchmarks"), str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "HYDRA_FULL_ERROR": "1", "LIT_SPEED_CACHE_DIR": str(out / "tuning"),
           "TOKENIZERS_PARALLELISM": "false"}
    synced = settle_disk()  # the previous row's export written out: not this row's writeback
    start = time.time()
    proc, timeline = run_sampled([*TIME_V, *cmd], env, out)
    row: dict[str, Any] = {"name": name, "command": " ".join(cmd[1:]), "exit": proc.returncode,
                           "sync_before_s": synced,
                           "wall_s": round(time.time() - start, 2), **time_v(proc.stderr),
                           "rss_peak_at_s": timeline["peak_at_s"], "rss_peak_anon_mib": timeline["peak_anon_mib"],
                           "rss_peak_file_mib": timeline["peak_file_mib"], "rss_mib_per_s": timeline["mib_per_s"]}
    if proc.returncode != 0:
        row["error"] = proc.stderr[-3000:]
        print(f"{name}: exit {proc.returncode}\n{row['error']}")
        return row
    if (out / "row.json").exists():
        record = json.loads((out / "row.json").read_text())
    else:
        record = json.loads((out / "steps.json").read_text())
        summary = json.loads((out / "summary.json").read_text())
        record.update(phases=summary["time_split_s"], launch_to_end_s=summary["launch_to_end_s"],
                      startup=summary["startup"], sft_trained_tokens=summary.get("sft_trained_tokens"))
    row.update({k: record.get(k) for k in ("loss", "step_s", "positions", "real_positions", "trained", "phases",
                                            "launch_to_end_s", "settings", "startup", "sft_trained_tokens")})
    print(f"{name}: {row['wall_s']:.1f} s, peak RSS {row.get('peak_rss_bytes', 0) / 2**30:.2f} GiB, losses "
          f"{[round(x, 4) for x in row['loss'] or []]}")
    return row


def equivalence(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    ensure_trl()
    model = build(MODEL)
    files = data_files(WORK / "data")
    template = WORK / "qwen2_5_generation.jinja"
    template.write_text(GENERATION_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(model)
    probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert tokenizer.apply_chat_template(probe, tokenize=False) == \
        tokenizer.apply_chat_template(probe, tokenize=False, chat_template=GENERATION_TEMPLATE), \
        "the marked template must render the folder's text"
    rows, compared = [], {}
    for fmt, path in files.items():
        shared = (model, path, None, args.steps, args.micro, args.max_length, args.r, args.lr)
        trl_extra = ["--order", "sequential", "--precision", "fp32", "--export", "0"] + (
            ["--chat-template", str(template)] if fmt == "messages" else [])
        lit_extra = ["data.shuffle=false", "data.packing=false", "precision=32-true", "peft.base_dtype=null",
                     f"data.val_source={path}", "trainer.limit_val_batches=0", "trainer.num_sanity_val_steps=0",
                     "validate=false", "trainer.val_check_interval=null", "data.samples=0", "peft.export=false",
                     "callbacks=[chunked_loss]"]
        trl = run(f"{fmt}/trl", trl_command(*shared[:2], WORK / fmt / "trl", *shared[3:], trl_extra), WORK / fmt / "trl")
        lit = run(f"{fmt}/lit_speed", lit_command(*shared[:2], WORK / fmt / "lit", *shared[3:], lit_extra),
                  WORK / fmt / "lit")
        rows += [trl, lit]
        if trl["exit"] == 0 and lit["exit"] == 0:
            diffs = [abs(a - b) for a, b in zip(trl["loss"], lit["loss"])]
            compared[fmt] = {"steps": len(diffs), "max_abs_loss_diff": max(diffs),
                             "max_rel_loss_diff": max(d / abs(b) for d, b in zip(diffs, trl["loss"])),
                             "trained_trl": sum(trl["trained"]), "trained_lit_speed": sum(lit["trained"]),
                             "trained_per_step_equal": trl["trained"] == lit["trained"],
                             "loss_trl": trl["loss"], "loss_lit_speed": lit["loss"]}
            print(f"{fmt}: {compared[fmt]}")
    line = "; ".join(f"{fmt}: {c['steps']} steps, max loss diff {c['max_abs_loss_diff']:.2e} (rel "
                     f"{c['max_rel_loss_diff']:.1e}), trained tokens {c['trained_trl']} (TRL) vs "
                     f"{c['trained_lit_speed']} (lit_speed), per step equal: {c['trained_per_step_equal']}"
                     for fmt, c in compared.items())
    write_result(f"sft_equivalence{args.tag}", {"rows": rows, "compared": compared, "model": MODEL,
                                                "settings": vars(args)},
                 f"{MODEL} dims, LoRA r={args.r} all-linear, {args.micro} x <= {args.max_length} tokens, fp32, "
                 f"unpacked, the file's order, beside TRL SFTTrainer in the same run: {line}")


#: the speed suite's rows: (tool, extra arguments). TRL: its default (padding, random order), packing=True (bfd) and
#: padding_free=True (one row per batch, position_ids); bf16 autocast where the CPU has bf16 units (--precision bf16).
#: lit_speed: the preset as a user types it (packing timed), then each layout named.
SPEED_ROWS: dict[str, tuple[str, list[str]]] = {
    "trl/default": ("trl", []),
    "trl/packing": ("trl", ["--packing"]),
    "trl/padding_free": ("trl", ["--padding-free"]),
    "lit_speed/default": ("lit", []),
    "lit_speed/packed": ("lit", ["data.packing=true"]),
    "lit_speed/padded": ("lit", ["data.packing=false"]),
    # the memory lever TRL's SFTConfig has on by default (gradient_checkpointing=True): the decoder layers recomputed
    "lit_speed/checkpointing": ("lit", ["callbacks=[default,chunked_loss,activation_checkpointing]",
                                        "callbacks.chunked_loss.chunk_mib=128"]),
    # the preset's packed rows with the decoder layers checkpointed: TRL's default memory lever on lit_speed's layout
    "lit_speed/packed_checkpointing": ("lit", ["data.packing=true",
                                               "callbacks=[default,chunked_loss,activation_checkpointing]",
                                               "callbacks.chunked_loss.chunk_mib=128"]),
}


def rows_per_batch(model: Path, data: Path, args: argparse.Namespace) -> int:
    """Packed rows of ``--max-length`` that hold ``--micro`` examples of ``data`` on average (lit_speed's packed
    layout's rule), so TRL's packing row trains the same tokens per step as the others."""
    from lit_speed.sft import SFTDataModule
    from lit_speed.sft.batches import Layout

    dm = SFTDataModule(str(data), tokenizer=str(model), cache_dir=str(WORK / "lit_cache"), max_length=args.max_length,
                       batch_size=args.micro, val_source=str(data))
    dm.setup()
    return Layout(dm.train_examples, args.micro, args.max_length, packed=True).batch_size


def row_command(name: str, model: Path, data: Path, out: Path, args: argparse.Namespace, micro: int, bf16: bool,
                template: Path, extra: tuple[str, ...] = ()) -> list[str]:
    """The command of speed row ``name`` (:data:`SPEED_ROWS`): the same JSONL, LoRA, LR, steps and clipping on both
    sides, bf16 autocast where the CPU has bf16 units, no validation; ``extra`` arguments last."""
    tool, row_extra = SPEED_ROWS[name]
    shared = (model, data, out, args.steps, micro, args.max_length, args.r, args.lr)
    if tool == "trl":
        return trl_command(*shared, ["--precision", "bf16" if bf16 else "fp32", "--chat-template", str(template),
                                     "--clip", "1.0", *row_extra, *extra])
    return lit_command(*shared, [f"data.val_source={data}", "trainer.limit_val_batches=0",
                                 "trainer.num_sanity_val_steps=0", "validate=false", "data.samples=0",
                                 "trainer.gradient_clip_val=1.0", *(["precision=bf16-mixed"] if bf16 else []),
                                 *row_extra, *extra])


def add_steady_rates(row: dict[str, Any], warmup: int) -> None:
    """Trained tokens and positions per second after ``warmup`` steps, the padding share, trained tokens a step."""
    timed = list(zip(row["step_s"], row["trained"], row["positions"], row["real_positions"]))[warmup:]
    seconds = sum(t[0] for t in timed)
    row.update(steady_trained_tokens_per_s=round(sum(t[1] for t in timed) / seconds, 2),
               steady_positions_per_s=round(sum(t[2] for t in timed) / seconds, 2),
               padding_share=round(1 - sum(t[3] for t in timed) / sum(t[2] for t in timed), 4),
               trained_per_step=round(sum(t[1] for t in timed) / len(timed), 1))


def speed(args: argparse.Namespace) -> None:
    """Steady trained tokens per second, peak RSS, launch to exported model, per row; the same JSONL (messages), the
    same LoRA, LR and steps, no validation on either side."""
    from real_size_peers import native_bf16

    ensure_trl()
    model = build(args.model)
    data = data_files(WORK / "data")["messages"]
    template = WORK / f"{args.model}_generation.jinja"
    template.write_text(GENERATION_TEMPLATES[args.model])
    bf16 = native_bf16()
    packed_rows = rows_per_batch(model, data, args)  # TRL's packing counts rows: the rows that hold --micro examples
    rows = []
    for name in args.rows or list(SPEED_ROWS):
        out = WORK / "speed" / name.replace("/", "_")
        micro = packed_rows if name == "trl/packing" else args.micro
        row = run(name, row_command(name, model, data, out, args, micro, bf16, template), out)
        if row["exit"] == 0:
            add_steady_rates(row, args.warmup)
            row["micro"] = micro
        rows.append(row)
    ok = {r["name"]: r for r in rows if r["exit"] == 0}
    trl = [r for n, r in ok.items() if n.startswith("trl/")]
    lit = [r for n, r in ok.items() if n.startswith("lit_speed/")]
    ratios = {}
    if trl and lit:
        fastest = max(trl, key=lambda r: r["steady_trained_tokens_per_s"])
        lightest = min(trl, key=lambda r: r["peak_rss_bytes"])
        quickest = min(trl, key=lambda r: r["launch_to_end_s"])
        for r in lit:
            ratios[r["name"]] = {
                "tokens_per_s_vs_trl_fastest": round(r["steady_trained_tokens_per_s"] /
                                                     fastest["steady_trained_tokens_per_s"], 3),
                "peak_rss_vs_trl_lowest": round(r["peak_rss_bytes"] / lightest["peak_rss_bytes"], 3),
                "launch_to_end_vs_trl_quickest": round(r["launch_to_end_s"] / quickest["launch_to_end_s"], 3),
                "trl_rows": {"fastest": fastest["name"], "lowest_rss": lightest["name"], "quickest": quickest["name"]}}
    line = "; ".join(f"{r['name']}: {r['steady_trained_tokens_per_s']:.0f} trained tok/s, "
                     f"{r['peak_rss_bytes'] / 2**30:.2f} GiB, {r['launch_to_end_s']:.0f} s to export, padding "
                     f"{r['padding_share']:.0%}" for r in ok.values())
    line += "; " + "; ".join(f"{n} vs TRL: tok/s x{v['tokens_per_s_vs_trl_fastest']}, RSS x{v['peak_rss_vs_trl_lowest']}"
                             f", launch-to-export x{v['launch_to_end_vs_trl_quickest']}" for n, v in ratios.items())
    picture(rows, RESULTS / f"sft_speed{args.tag}.png")
    write_result(f"sft_speed{args.tag}", {"rows": rows, "ratios": ratios, "model": args.model, "bf16": bf16,
                                          "settings": vars(args)},
                 f"{args.model} dims, LoRA r={args.r}, {args.steps} steps of {args.micro} items <= {args.max_length} tokens, "
                 f"{'bf16 autocast' if bf16 else 'fp32'}, no validation, beside TRL SFTTrainer: {line}")


def picture(rows: list[dict[str, Any]], path: Path) -> None:
    """Loss against wall time from launch (each step at the time it ended), and peak RSS, per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("exit") == 0 and r.get("loss")]
    fig, (loss_ax, rss_ax) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    for r in ok:
        before = r["launch_to_end_s"] - sum(r["step_s"]) - (r.get("phases") or {}).get("export", 0.0)
        ends, clock = [], before
        for seconds in r["step_s"]:
            clock += seconds
            ends.append(clock)
        loss_ax.plot(ends, r["loss"], marker=".", label=r["name"])
    loss_ax.set_xlabel("seconds from launch (the start-up before the first step estimated as the rest)")
    loss_ax.set_ylabel("training loss per step")
    loss_ax.legend(fontsize=7)
    rss_ax.barh([r["name"] for r in ok], [r["peak_rss_bytes"] / 2**30 for r in ok])
    rss_ax.set_xlabel("peak RSS (GiB, /usr/bin/time -v)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=["equivalence", "speed"], default="equivalence")
    parser.add_argument("--rows", nargs="*", choices=list(SPEED_ROWS), help="speed rows (default: all)")
    parser.add_argument("--warmup", type=int, default=2, help="speed: steps left out of the steady rate")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--tag", default="")
    parser.add_argument("--model", choices=sorted(GENERATION_TEMPLATES), default=MODEL,
                        help="speed: the model folder's dimensions (benchmarks/model_folders.py)")
    parser.add_argument("--picture", type=Path, help="only draw the PNG of a speed result JSON (results/*.json)")
    args = parser.parse_args(argv)
    if args.picture:
        picture(json.loads(args.picture.read_text())["results"]["rows"], args.picture.with_suffix(".png"))
        return
    {"equivalence": equivalence, "speed": speed}[args.suite](args)


if __name__ == "__main__":
    main()
