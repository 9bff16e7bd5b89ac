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
from _common import write_result  # noqa: E402
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
    start = time.time()
    proc, timeline = run_sampled([*TIME_V, *cmd], env, out)
    row: dict[str, Any] = {"name": name, "command": " ".join(cmd[1:]), "exit": proc.returncode,
                           "wall_s": round(time.time() - start, 2), **time_v(proc.stderr),
                           "rss_peak_at_s": timeline["peak_at_s"]}
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=["equivalence"], default="equivalence")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    {"equivalence": equivalence}[args.suite](args)


if __name__ == "__main__":
    main()
