"""Real size: fine-tuning open-model-sized folders with lit_speed beside Hugging Face's Trainer and plain Lightning.

    python benchmarks/bench_real_size.py --suite speed      # issue 31: 0.5B LoRA + full, launch to exported model
    python benchmarks/bench_real_size.py --suite memory     # issue 32: 1B LoRA r=16, 0.5B full and LoRA, peak RSS
    python benchmarks/bench_real_size.py --rows lora05/lit_speed,lora05/trainer --steps 2   # some rows
    python benchmarks/bench_real_size.py --list             # the rows and their commands
    python benchmarks/bench_real_size.py --suite memory --plan   # + scripts/plan.py before each lit_speed row (item 3)
    python benchmarks/bench_real_size.py --device cuda --steps 30   # on one GPU: every row on it, in bf16

Model folders: ``model_folders.py`` (Qwen2.5-0.5B and Llama-3.2-1B dimensions, random weights, a tokenizer trained
here). Corpus: the installed Lightning package's source, tokenised once by lit_speed (cached). Every row is a fresh
process under ``/usr/bin/time -v`` (peak RSS of the process, wall, user/system seconds, page faults) and trains the
same windows in the same order, from the same adapter initialisation (``real_size_peers.py`` explains how; each row
records the hash of its first batch and its loss at every step, compared in the result).

Per row: peak RSS and where the memory goes (``memory_breakdown.py``: weights, gradients, optimizer state and the
activations saved for backward, measured at the same points in every tool; the rest of the peak RSS is the process's
own), launch to end (= exported model), the time split (start-up, model load, adapters, data, sanity/validation,
training, checkpoints, export), steady tokens/s (steps after the first two), MFU (model FLOPs of the step against
the measured matmul peak of the dtype in use on this machine: fp32, or bf16 where the row computes in bf16), peak
RSS, and the ratios against the Trainer row of the same group, measured in the same run. ``--device cuda`` puts every
row on the GPU in bf16 autocast (lit_speed: ``trainer=gpu precision=bf16-mixed``; the Trainer: ``bf16=True, tf32=True``;
plain Lightning: ``accelerator="gpu"``), synchronises before each step's clock stops, records the GPU's peak allocated
memory, and measures the matmul peak on the GPU. Rows run one after the
other with nothing else on the machine (the load average is recorded before and after). Result: JSON in
``benchmarks/results/real_size_<suite>.json``, a dated line in ``LOG.md``, a PNG beside the JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, ROOT, machine, settle_disk, write_result  # noqa: E402
from model_folders import SPECS, build  # noqa: E402

WORK = ROOT / ".cache" / "bench_real_size"
LORA_TARGETS = "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"
WARMUP = 2


def lightning_source() -> str:
    from lit_speed.data.charlm import source_root

    return str(source_root("lightning"))


def lit_command(model: str, mode: str, steps: int, block: int, micro: int, r: int, lr: float, extra: list[str],
                out: Path, device: str = "cpu") -> list[str]:
    """``scripts/train.py`` for a row: the same model, data, batches, optimizer and constant LR as the peers."""
    from lit_speed.compat.torch import cpu_has_native_bf16

    base = ["model=hf_causal_lm", "data=text_folder", f"model.pretrained={build(model)}",
            f"data.root={lightning_source()}", f"data.block_size={block}", f"data.batch_size={micro}",
            f"trainer.max_steps={steps}", "optimizer.lr=" + str(lr), "model.scheduler=null", "logger=none",
            "trainer.enable_progress_bar=false", f"hydra.run.dir={out}",
            "trainer.gradient_clip_val=1.0",  # transformers.Trainer clips at max_grad_norm=1.0 by default
            "+callbacks.bench._target_=real_size_recorder.StepRecorder", f"+callbacks.bench.out={out}/steps.json"]
    if mode == "lora":
        base += ["peft=lora", f"peft.target_modules={LORA_TARGETS}", f"peft.r={r}", f"peft.alpha={2 * r}",
                 f"peft.export_dir={out}/merged"]
    own_precision = any(e.startswith("precision=") for e in extra)
    if device == "cuda":  # what a user types for one GPU; the Trainer's row runs bf16=True
        base += ["trainer=gpu"] + ([] if own_precision else ["precision=bf16-mixed"])
    elif not own_precision and cpu_has_native_bf16():
        # a CPU with bf16 kernels (AVX512-BF16/AMX): the peers' speed rows run bf16 autocast there, so the same flag
        base += ["precision=bf16-mixed"]
    return [sys.executable, str(ROOT / "scripts" / "train.py"), *base, *extra]


def peer_command(tool: str, model: str, mode: str, flags: str, steps: int, block: int, micro: int, r: int, lr: float,
                 out: Path, device: str = "cpu") -> list[str]:
    return [sys.executable, str(ROOT / "benchmarks" / "real_size_peers.py"), tool, "--model", str(build(model)),
            "--data-root", lightning_source(), "--mode", mode, "--flags", flags, "--steps", str(steps),
            "--block", str(block), "--micro", str(micro), "--r", str(r), "--lr", str(lr), "--out", str(out / "row.json"),
            "--device", device]


#: lit_speed's levers per row, as Hydra overrides (what a user types). Filled from the components that exist.
#: Speed rows: freed memory kept for the next step (no page faults), no sanity check before the first step (the
#: validation step is lit_speed's own; the final validation still runs and is in the time).
#: The decoder layers compiled (callbacks=compile, regional: one layer compiled, reused by all), from a cold inductor
#: cache (each row gets an empty TORCHINDUCTOR_CACHE_DIR: the compile is in launch-to-end, as in a user's first run).
LIT_LORA_EAGER: list[str] = ["callbacks=[default,chunked_loss,keep_freed_memory]", "trainer.num_sanity_val_steps=0"]
LIT_LORA: list[str] = ["callbacks=[default,chunked_loss,keep_freed_memory,compile]", "trainer.num_sanity_val_steps=0"]
LIT_LORA_NOVAL: list[str] = [*LIT_LORA, "validate=false", "trainer.limit_val_batches=0"]
#: the no-validation rows without the compile (a short run on a GPU: the cold compile against the steps it speeds up)
LIT_LORA_EAGER_NOVAL: list[str] = [*LIT_LORA_EAGER, "validate=false", "trainer.limit_val_batches=0"]
LIT_FULL: list[str] = ["peft=none", "optimizer=adamw_fused",
                       "callbacks=[default,chunked_loss,keep_freed_memory,compile]", "trainer.num_sanity_val_steps=0"]
#: full fine-tuning, the Trainer row's job: train, then the trained model's save_pretrained folder (peft=none's
#: export); no validation and no resumable checkpoint (weights + AdamW state, 6 GB at 0.5B: save_strategy="no" there)
LIT_FULL_NOVAL: list[str] = [*LIT_FULL, "validate=false", "trainer.limit_val_batches=0", "~callbacks.model_checkpoint"]
LIT_FULL_EAGER_NOVAL: list[str] = ["peft=none", "optimizer=adamw_fused", *LIT_LORA_EAGER_NOVAL,
                                   "~callbacks.model_checkpoint"]
LIT_MEMORY_LORA: list[str] = ["peft.base_dtype=bf16",
                               "callbacks=[default,chunked_loss,activation_checkpointing,return_freed_memory]"]
LIT_MEMORY_LORA_INT8: list[str] = ["peft.base_dtype=int8", *LIT_MEMORY_LORA[1:]]
LIT_MEMORY_FULL: list[str] = ["peft=none", "optimizer=adamw8bit",
                              "callbacks=[default,chunked_loss,activation_checkpointing,return_freed_memory]"]

#: a peer's flags ending in this run it with glibc told what KeepFreedMemory tells it (MALLOC_MMAP_MAX_=0, no trim)
KEEP = ":keep"
KEEP_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "2147483647"}

#: name -> (group, model, mode, r, kind, spec): kind "lit" (spec: extra overrides) or a peer tool (spec: its flags)
SUITES: dict[str, dict[str, tuple[str, str, str, int, str, Any]]] = {
    "speed": {
        "lora05/trainer": ("lora05", "qwen2.5-0.5b", "lora", 8, "trainer", "speed"),
        # the Trainer with the same allocator setting as lit_speed's keep_freed_memory, from the environment
        "lora05/trainer_keep": ("lora05", "qwen2.5-0.5b", "lora", 8, "trainer", "speed" + KEEP),
        # the Trainer over a base loaded in bf16 (from_pretrained(dtype=torch.bfloat16), adapters float32 by peft)
        "lora05/trainer_bf16base": ("lora05", "qwen2.5-0.5b", "lora", 8, "trainer", "bf16base"),
        # the Trainer's own compile flag (torch_compile=True: the whole model through torch.compile)
        "lora05/trainer_compile": ("lora05", "qwen2.5-0.5b", "lora", 8, "trainer", "compile"),
        "lora05/lightning": ("lora05", "qwen2.5-0.5b", "lora", 8, "lightning", "speed"),
        # the command a user types (no speed flags): its sanity check, final validation and export as configured
        "lora05/lit_speed_default": ("lora05", "qwen2.5-0.5b", "lora", 8, "lit", []),
        "lora05/lit_speed_eager": ("lora05", "qwen2.5-0.5b", "lora", 8, "lit", LIT_LORA_EAGER),
        "lora05/lit_speed": ("lora05", "qwen2.5-0.5b", "lora", 8, "lit", LIT_LORA),
        # the Trainer rows' job: train and export, no validation (lit_speed's final validation is work they skip)
        "lora05/lit_speed_noval": ("lora05", "qwen2.5-0.5b", "lora", 8, "lit", LIT_LORA_NOVAL),
        "lora05/lit_speed_eager_noval": ("lora05", "qwen2.5-0.5b", "lora", 8, "lit", LIT_LORA_EAGER_NOVAL),
        # the frozen base held in bf16 (peft.base_dtype=bf16): under bf16 autocast each matmul is the same bf16(W) @ x
        # as the Trainer's, without casting the float32 weight at every forward and backward (a CPU with bf16 kernels)
        "lora05/lit_speed_bf16base_noval": ("lora05", "qwen2.5-0.5b", "lora", 8, "lit",
                                            [*LIT_LORA_NOVAL, "peft.base_dtype=bf16"]),
        "lora05/lit_speed_eager_bf16base_noval": ("lora05", "qwen2.5-0.5b", "lora", 8, "lit",
                                                  [*LIT_LORA_EAGER_NOVAL, "peft.base_dtype=bf16"]),
        # the same LoRA job on the Llama-3.2-1B dims folder (1.24B parameters, vocabulary 128,256). No full 1B rows:
        # float32 weights, gradients and AdamW state alone are 19.8 GB, the Trainer's run does not fit 24 GiB
        "lora1b/trainer": ("lora1b", "llama-3.2-1b", "lora", 8, "trainer", "speed"),
        "lora1b/lit_speed_eager_noval": ("lora1b", "llama-3.2-1b", "lora", 8, "lit", LIT_LORA_EAGER_NOVAL),
        "full05/trainer": ("full05", "qwen2.5-0.5b", "full", 0, "trainer", "speed"),
        "full05/lit_speed": ("full05", "qwen2.5-0.5b", "full", 0, "lit", LIT_FULL),
        "full05/lit_speed_noval": ("full05", "qwen2.5-0.5b", "full", 0, "lit", LIT_FULL_NOVAL),
        "full05/lit_speed_eager_noval": ("full05", "qwen2.5-0.5b", "full", 0, "lit", LIT_FULL_EAGER_NOVAL),
        # a bf16 module with float32 master weights (no per-op casts; the optimizer steps the float32 masters)
        "full05/lit_speed_master_noval": ("full05", "qwen2.5-0.5b", "full", 0, "lit",
                                          [*LIT_FULL_NOVAL, "precision=bf16-master"]),
        "full05/lit_speed_eager_master_noval": ("full05", "qwen2.5-0.5b", "full", 0, "lit",
                                                [*LIT_FULL_EAGER_NOVAL, "precision=bf16-master"]),
    },
    "memory": {
        "lora1b/trainer": ("lora1b", "llama-3.2-1b", "lora", 16, "trainer", "memory"),
        "lora1b/lightning": ("lora1b", "llama-3.2-1b", "lora", 16, "lightning", "speed"),
        "lora1b/lit_speed": ("lora1b", "llama-3.2-1b", "lora", 16, "lit", LIT_MEMORY_LORA),
        "lora1b/lit_speed_int8": ("lora1b", "llama-3.2-1b", "lora", 16, "lit", LIT_MEMORY_LORA_INT8),
        "lora05/trainer": ("lora05", "qwen2.5-0.5b", "lora", 8, "trainer", "memory"),
        "lora05/lit_speed": ("lora05", "qwen2.5-0.5b", "lora", 8, "lit", LIT_MEMORY_LORA),
        "lora05/lit_speed_int8": ("lora05", "qwen2.5-0.5b", "lora", 8, "lit", LIT_MEMORY_LORA_INT8),
        "full05/trainer_default": ("full05", "qwen2.5-0.5b", "full", 0, "trainer", "default"),
        "full05/trainer": ("full05", "qwen2.5-0.5b", "full", 0, "trainer", "memory"),
        "full05/lit_speed": ("full05", "qwen2.5-0.5b", "full", 0, "lit", LIT_MEMORY_FULL),
    },
}


def flops_per_token(model: str, block: int, mode: str) -> float:
    """Model FLOPs of one training token: forward 2N (N = matmul weights, the LM head included) plus attention
    (4 x layers x block x hidden: QK^T and AV over the whole window), the input gradients as much again, and the
    weight gradients (2N) when every weight trains; LoRA's own matmuls are below 1% and left out."""
    s = SPECS[model]
    h, i, layers, vocab = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["vocab_size"]
    head_dim = s.get("head_dim", h // s["num_attention_heads"])
    kv = s["num_key_value_heads"] * head_dim
    q = s["num_attention_heads"] * head_dim
    n = layers * (2 * h * q + 2 * h * kv + 3 * h * i) + h * vocab
    forward = 2 * n + 4 * layers * block * q
    return forward * 2 + (2 * n if mode == "full" else 0)


def matmul_peak(dtype: str, size: int = 2048, repeats: int = 5, device: str = "cpu") -> float:
    """Measured GEMM FLOP/s of ``dtype`` at ``size``^2 with this process's threads, or on the GPU (median of
    ``repeats``)."""
    import statistics

    import torch

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    a, b = torch.randn(size, size, dtype=dt, device=device), torch.randn(size, size, dtype=dt, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    a @ b
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        sync()
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times)


def time_v(stderr: str) -> dict[str, float]:
    """The numbers ``/usr/bin/time -v`` printed."""
    fields = {"Maximum resident set size (kbytes)": ("peak_rss_bytes", 1024), "User time (seconds)": ("user_s", 1),
              "System time (seconds)": ("sys_s", 1), "Minor (reclaiming a frame) page faults": ("minor_faults", 1)}
    out: dict[str, float] = {}
    for line in stderr.splitlines():
        key, _, value = line.strip().rpartition(": ")
        if key in fields:
            name, scale = fields[key]
            out[name] = float(value) * scale
    return out


def run_sampled(cmd: list[str], env: dict[str, str], out: Path, every_s: float = 0.25
                ) -> tuple[subprocess.CompletedProcess, dict[str, Any]]:
    """Run ``cmd`` and sample the RSS of its processes (anonymous and file-backed, ``/proc/<pid>/status``) every
    ``every_s``: when the peak happens tells which phase makes it (loading, the fit check, a step, validation, the
    export), which the peak alone cannot. Output goes to ``out/stdout.txt`` and ``out/stderr.txt``. Returns the
    finished process and the timeline: one sample per second (the largest of that second, MiB) and the peak's time
    and split."""
    import psutil

    with open(out / "stdout.txt", "w") as stdout, open(out / "stderr.txt", "w") as stderr:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, text=True, env=env, cwd=ROOT)
    start, seconds, peak = time.time(), {}, (0, 0.0, 0, 0)
    while proc.poll() is None:
        anon = file = 0
        try:
            for child in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(OSError), open(f"/proc/{child.pid}/status") as status:
                    fields = dict(line.split(":", 1) for line in status if ":" in line)
                    anon += int(fields.get("RssAnon", "0 kB").split()[0]) // 1024
                    file += int(fields.get("RssFile", "0 kB").split()[0]) // 1024
        except psutil.Error:
            pass
        now = time.time() - start
        seconds[int(now)] = max(seconds.get(int(now), 0), anon + file)
        if anon + file > peak[0]:
            peak = (anon + file, round(now, 1), anon, file)
        time.sleep(every_s)
    done = subprocess.CompletedProcess(cmd, proc.returncode, (out / "stdout.txt").read_text(),
                                       (out / "stderr.txt").read_text())
    return done, {"mib_per_s": [seconds[k] for k in sorted(seconds)], "peak_mib": peak[0], "peak_at_s": peak[1],
                  "peak_anon_mib": peak[2], "peak_file_mib": peak[3]}


#: ``/usr/bin/time -v`` where the machine has it (GNU time); else the peak comes from the RSS samples
TIME_V = ["/usr/bin/time", "-v"] if Path("/usr/bin/time").exists() else []


def run_plan(train_cmd: list[str], env: dict[str, str], out: Path) -> dict[str, Any]:
    """``scripts/plan.py`` with the row's own overrides, as a user asks "will it fit" before the run: its wall time,
    peak RSS and the configured row's predicted peak RSS (issue 32: under a minute, within 15% of the measured)."""
    overrides = [a for a in train_cmd[2:] if not a.startswith(("hydra.run.dir=", "+callbacks.bench"))]
    start = time.time()
    proc = subprocess.run([*TIME_V, sys.executable, str(ROOT / "scripts" / "plan.py"), *overrides,
                           "--json", str(out / "plan.json")], capture_output=True, text=True, env=env, cwd=ROOT)
    result: dict[str, Any] = {"exit": proc.returncode, "wall_s": round(time.time() - start, 2),
                              "peak_rss_bytes": time_v(proc.stderr).get("peak_rss_bytes")}
    if proc.returncode not in (0, 1):
        result["error"] = proc.stderr[-2000:]
        return result
    rows = json.loads((out / "plan.json").read_text())["rows"]
    result.update(predicted_peak_bytes=rows[0]["peak"], predicted_parts=rows[0], rows=len(rows))
    return result


def run_row(name: str, spec: tuple, args: argparse.Namespace) -> dict[str, Any]:
    group, model, mode, r, kind, extra = spec
    out = WORK / name.replace("/", "_")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    if kind == "lit":
        cmd = lit_command(model, mode, args.steps, args.block, args.micro, r, args.lr, list(extra), out, args.device)
    else:
        flags = extra.removesuffix(KEEP)
        cmd = peer_command(kind, model, mode, flags, args.steps, args.block, args.micro, r, args.lr, out, args.device)
    path = os.pathsep.join(p for p in (str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "HYDRA_FULL_ERROR": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(out / "inductor_cache"),  # cold: a compiling row pays its compile
           "LIT_SPEED_CACHE_DIR": str(out / "lit_speed_cache"),  # cold: lit_speed's timed choices (auto) are timed
           **(KEEP_ENV if kind != "lit" and extra.endswith(KEEP) else {})}
    plan = run_plan(cmd, env, out) if kind == "lit" and args.plan else None
    synced = settle_disk()  # the previous row's export written out: not this row's writeback
    start = time.time()
    proc, timeline = run_sampled([*TIME_V, *cmd], env, out)
    wall = time.time() - start
    row: dict[str, Any] = {"name": name, "group": group, "model": model, "mode": mode, "r": r, "tool": kind,
                           "command": " ".join(cmd[1:]), "exit": proc.returncode, "wall_s": round(wall, 2),
                           "sync_before_s": synced,
                           **time_v(proc.stderr), "rss_timeline": timeline}
    if not TIME_V:  # no GNU time here: the largest of the 0.25 s samples
        row["peak_rss_bytes"], row["peak_rss_from"] = timeline["peak_mib"] * 2**20, "rss samples"
    if proc.returncode != 0:
        row["error"] = proc.stderr[-2000:]
        return row
    if kind == "lit":
        summary = json.loads((out / "summary.json").read_text())
        steps = json.loads((out / "steps.json").read_text())
        row.update(step_s=steps["step_s"], loss=steps["loss"], first_batch_sha=steps["first_batch_sha"],
                   cuda_peak_bytes=steps.get("cuda_peak_bytes"),
                   memory_breakdown=steps.get("memory_breakdown"), phases=summary["time_split_s"],
                   launch_to_end_s=summary["launch_to_end_s"],
                   settings={"precision": summary["startup"].get("precision"), "startup": summary["startup"]})
    else:
        record = json.loads((out / "row.json").read_text())
        row.update(step_s=record["step_s"], loss=record["loss"], first_batch_sha=record["first_batch_sha"],
                   cuda_peak_bytes=record.get("cuda_peak_bytes"),
                   memory_breakdown=record.get("memory_breakdown"), phases=record["phases"],
                   launch_to_end_s=record["launch_to_end_s"], settings=record["settings"])
    if plan is not None:
        row["plan"] = plan
        if plan.get("predicted_peak_bytes") and row.get("peak_rss_bytes"):
            plan["predicted_over_measured"] = round(plan["predicted_peak_bytes"] / row["peak_rss_bytes"], 3)
    if row.get("memory_breakdown") and row.get("peak_rss_bytes"):
        row["memory_breakdown"]["process_rest"] = row["peak_rss_bytes"] - row["memory_breakdown"]["tensor_bytes"]
    tokens = args.micro * args.block
    timed = row["step_s"][WARMUP:] if len(row["step_s"]) > WARMUP else row["step_s"]
    row["steady_tokens_per_s"] = round(tokens * len(timed) / sum(timed), 2)
    row["median_step_s"] = round(sorted(timed)[len(timed) // 2], 3)
    bf16 = args.device == "cuda" or ("bf16" in json.dumps(row.get("settings", {})).lower()
                                      and "true" in json.dumps(row["settings"]).lower())
    peak = args.peaks["bf16" if bf16 and "bf16" in args.peaks else "fp32"]
    row["mfu"] = round(flops_per_token(model, args.block, mode) * row["steady_tokens_per_s"] / peak, 4)
    # the row's steps alone at the measured matmul peak (no start-up, no compile, nothing but the model's FLOPs): no
    # launch-to-end below it is possible on this machine in this dtype
    row["floor_s"] = round(flops_per_token(model, args.block, mode) * tokens * len(row["step_s"]) / peak, 1)
    return row


def compare(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Ratios of each row to its group's Trainer row (``<group>/trainer``), and the loss agreement; lit_speed's rows
    also to the Trainer told the same allocator setting (``<group>/trainer_keep``, key ``<row> vs trainer_keep``) and
    over a bf16-loaded base (``<group>/trainer_bf16base``)."""
    out: dict[str, dict[str, Any]] = {}
    by_name = {r["name"]: r for r in rows if r.get("exit") == 0}
    pairs = [(row, by_name.get(f"{row['group']}/trainer"), row["name"]) for row in by_name.values()]
    pairs += [(row, by_name.get(f"{row['group']}/{peer}"), f"{row['name']} vs {peer}")
              for row in by_name.values() if row["tool"] == "lit" for peer in ("trainer_keep", "trainer_bf16base")]
    for row, ref, key in pairs:
        if ref is None or ref is row:
            continue
        losses = [abs(a - b) for a, b in zip(row["loss"], ref["loss"])]
        out[key] = {
            "launch_to_end_x": round(row["wall_s"] / ref["wall_s"], 3),
            "steady_tokens_per_s_x": round(row["steady_tokens_per_s"] / ref["steady_tokens_per_s"], 3),
            "peak_rss_x": round(row["peak_rss_bytes"] / ref["peak_rss_bytes"], 3),
            # the best launch_to_end_x any tool could reach here: the steps at the matmul peak, nothing else
            "launch_to_end_floor_x": round(row["floor_s"] / ref["wall_s"], 3),
            "same_batches": row["first_batch_sha"] == ref["first_batch_sha"],
            **({"cuda_peak_x": round(row["cuda_peak_bytes"] / ref["cuda_peak_bytes"], 3)}
               if row.get("cuda_peak_bytes") and ref.get("cuda_peak_bytes") else {}),
            "max_loss_diff": round(max(losses), 5) if losses else None,
        }
    return out


def picture(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("exit") == 0]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.5 * len(ok) + 2))
    names = [r["name"] for r in ok]
    left = [0.0] * len(ok)
    for part in ("weights", "gradients", "optimizer_state", "saved_activations", "process_rest"):
        values = [max(0.0, (r.get("memory_breakdown") or {}).get(part, 0)) / 2**30 for r in ok]
        axes[0].barh(names, values, left=left, label=part)
        left = [a + b for a, b in zip(left, values)]
    axes[0].scatter([r["peak_rss_bytes"] / 2**30 for r in ok], names, marker="|", color="black", s=200,
                    label="peak RSS")
    axes[0].set_xlabel("GiB: where the memory goes (tensors: each part's largest; the rest up to peak RSS)")
    axes[0].legend(fontsize=7, loc="lower right")
    left = [0.0] * len(ok)
    phases = sorted({p for r in ok for p in r["phases"]})
    for phase in phases:
        values = [r["phases"].get(phase, 0.0) for r in ok]
        axes[1].barh(names, values, left=left, label=phase)
        left = [a + b for a, b in zip(left, values)]
    axes[1].set_xlabel("seconds from launch (by phase)")
    axes[1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=sorted(SUITES), default="speed")
    parser.add_argument("--rows", default="", help="comma-separated row names of the suite (default: all)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--block", type=int, default=512)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: every row on the GPU in bf16 autocast (default: this machine's CPU)")
    parser.add_argument("--plan", action="store_true",
                        help="before each lit_speed row, time scripts/plan.py on its overrides and compare its "
                             "predicted peak RSS with the row's measured one")
    parser.add_argument("--tag", default="", help="suffix of the result's name")
    parser.add_argument("--no-write", action="store_true", help="print the rows, write no result (exploration)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    suite = SUITES[args.suite]
    names = [n for n in args.rows.split(",") if n] or list(suite)
    unknown = [n for n in names if n not in suite]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; the {args.suite} suite has {list(suite)}")
    if args.list:
        for n in names:
            print(n, suite[n])
        return
    info = machine()
    print(f"machine: {info.get('cpu')} {info.get('cpu_id')} bf16 kernels: {info.get('mkldnn_bf16')} "
          f"GPU: {info.get('gpu')}", flush=True)
    if args.device == "cuda" and not info.get("gpu"):
        raise SystemExit("--device cuda: no CUDA device here. Fix: run it on a machine with one GPU, or --device cpu")
    load_before = os.getloadavg()
    if args.device == "cuda":
        args.peaks = {"bf16": matmul_peak("bf16", size=8192, repeats=10, device="cuda")}
    else:
        args.peaks = {"fp32": matmul_peak("fp32")}
    if args.device == "cpu" and info.get("mkldnn_bf16"):
        args.peaks["bf16"] = matmul_peak("bf16")
    print(f"matmul peak GFLOP/s: { {k: round(v / 1e9, 1) for k, v in args.peaks.items()} }", flush=True)
    rows = []
    for name in names:
        row = run_row(name, suite[name], args)
        rows.append(row)
        shown = {k: row.get(k) for k in ("name", "exit", "wall_s", "peak_rss_bytes", "steady_tokens_per_s", "mfu",
                                         "phases", "loss")}
        shown["peak"] = {k: v for k, v in row.get("rss_timeline", {}).items() if k != "mib_per_s"}
        shown["plan"] = {k: v for k, v in row.get("plan", {}).items() if k in ("wall_s", "predicted_peak_bytes",
                                                                              "predicted_over_measured", "exit")}
        print(json.dumps(shown, default=str), flush=True)
    load_after = os.getloadavg()
    ratios = compare(rows)
    print(json.dumps(ratios, indent=1))
    name = f"real_size_{args.suite}{args.tag}"
    results = {"device": args.device, "machine": info, "rows": rows, "ratios": ratios, "steps": args.steps,
               "block": args.block, "micro": args.micro,
               "lr": args.lr, "matmul_peak_flops": args.peaks, "load_before": load_before, "load_after": load_after}
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    if args.no_write:
        return
    picture(rows, RESULTS / f"{name}.png")
    line = "; ".join(f"{k}: launch-to-end x{v['launch_to_end_x']}, tokens/s x{v['steady_tokens_per_s_x']}, peak RSS "
                     f"x{v['peak_rss_x']}" for k, v in ratios.items()) or "no ratios (a reference row is missing)"
    line += "; " + ", ".join(f"{r['name']} {r.get('peak_rss_bytes', 0) / 2**30:.2f} GiB"
                             + (f" (tensors {r['memory_breakdown']['tensor_bytes'] / 2**30:.2f})"
                                if r.get("memory_breakdown") else "")
                             + (f" GPU peak {r['cuda_peak_bytes'] / 2**30:.2f} GiB" if r.get("cuda_peak_bytes") else "")
                             + f" {r['wall_s']:.0f} s"
                             + (f" (plan.py {r['plan']['wall_s']:.0f} s, predicted x{r['plan']['predicted_over_measured']})"
                                if r.get("plan", {}).get("predicted_over_measured") else "")
                             + ("" if r.get("exit") == 0 else " FAILED") for r in rows)
    line += f"; load {load_before[0]:.1f} -> {load_after[0]:.1f}"
    if args.device == "cuda":
        line += f"; every row on {info.get('gpu')} (bf16 autocast), {args.steps} steps"
    write_result(name, results, line)


if __name__ == "__main__":
    main()
