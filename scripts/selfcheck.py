"""Check that lit_speed works, and speeds things up, on *your* hardware; print a pass/fail table.

    python scripts/selfcheck.py          # CPU checks (a minute or two): the wiring and this CPU's bf16 support
    python scripts/selfcheck.py --gpu    # GPU-only checks the test suite skips on CPU machines
    python scripts/selfcheck.py --gpu --table   # + tokens/s and peak memory table (<= 10 min on one GPU)

Every check runs real training commands (``scripts/train.py``, one fresh process each) and reads
their ``summary.json``. GPU checks: bf16-mixed and 16-mixed give more steady tokens/s than 32-true on
the charlm GPT at the table's size (12 layers, 768 wide: the laptop size is launch-bound on a GPU); the
device-stats logger reads NVML (``stats/gpu_util_pct`` in the CSV log); ZeRO-2 with optimizer offload
trains on CUDA to a finite loss. With ``--gpu`` and no CUDA device, every GPU check is
listed as not run with the reason, and the exit code is 1 (nothing was verified).
``--table`` also measures, in-process on the GPU, tokens/s and peak allocated memory of a 12-layer, 768-wide
charlm GPT per precision (32-true, tf32, bf16-mixed, 16-mixed) x micro-batch (1, 2, 4, 8), with activation
checkpointing, and under ZeRO stages 1/2/3 with and without offload; it prints the table, one verdict line
per technique and the checks, and writes ``gpu_table.json`` + ``gpu_table.md`` (``--out``). Without a CUDA
device it prints one line saying so and exits 1.
Exit code: 0 when every check that ran passed and at least one ran; 1 otherwise.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
CHARLM = ["experiment=charlm_cpu", "trainer.max_steps=60", "trainer.val_check_interval=30",
          "trainer.limit_val_batches=2", "trainer.enable_progress_bar=false"]
#: The precision checks' size: the --table's GPT (selfcheck_table.GPT_SIZE, BLOCK: ~85M parameters), micro-batch 8.
GPU_GPT = ["experiment=charlm_cpu", "model.n_layer=12", "model.n_head=12", "model.n_embd=768", "data.block_size=256",
           "data.batch_size=8", "trainer.max_steps=150", "trainer.val_check_interval=150", "trainer.limit_val_batches=2",
           "trainer.enable_progress_bar=false"]
GPU_GPT_WORDS = "GPT 12L/768d, context 256, micro-batch 8, steady tokens/s"
MIN_SPEEDUP = 1.05  # a low-precision mode must beat fp32 by more than run-to-run noise to count as faster


@dataclass
class Result:
    name: str
    status: str   # "pass" | "fail" | "not run"
    detail: str


def speedup_verdict(fp32_tokens_per_sec: float, low_tokens_per_sec: float, min_speedup: float = MIN_SPEEDUP) -> tuple[bool, str]:
    """Whether a low-precision mode is faster than fp32, and the measured ratio in words."""
    ratio = low_tokens_per_sec / fp32_tokens_per_sec
    return ratio >= min_speedup, f"x{ratio:.2f} tokens/s vs 32-true (pass needs >= x{min_speedup})"


def exit_code(results: list[Result]) -> int:
    ran = [r for r in results if r.status != "not run"]
    return 0 if ran and all(r.status == "pass" for r in ran) else 1


def error_line(stderr: str, returncode: int) -> str:
    """The line of a failed run's stderr that says what went wrong: the last ``SomeError: ...`` line (Hydra's
    closing hint to set HYDRA_FULL_ERROR names no cause), else the last non-empty line, else the exit code."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    causes = [line for line in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b", line)]
    return (causes or lines or [f"exit {returncode}"])[-1]


def train(overrides: list[str], out: Path) -> dict:
    """Run scripts/train.py in a fresh process; return its summary.json. On failure, raise with the error's own
    line and keep the whole stderr in ``<out>/stderr.txt`` (Hydra's full traceback: HYDRA_FULL_ERROR=1)."""
    env = {**os.environ, "HYDRA_FULL_ERROR": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), *overrides, f"hydra.run.dir={out}"],
                          cwd=ROOT, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "stderr.txt").write_text(proc.stderr)
        raise RuntimeError(f"{error_line(proc.stderr, proc.returncode)} (stderr: {out / 'stderr.txt'})")
    return json.loads((out / "summary.json").read_text())


def check_default_run(tmp: Path) -> Result:
    s = train(["trainer.max_epochs=5", "trainer.enable_progress_bar=false"], tmp / "digits")
    acc = s["final_val"]["val/acc"]
    return Result("default digits run (5 epochs)", "pass" if acc >= 0.9 else "fail", f"val/acc {acc:.3f} (pass >= 0.9)")


def check_charlm_cpu(tmp: Path) -> Result:
    s = train(CHARLM + ["trainer=cpu"], tmp / "charlm")
    loss, base = s["final_val"]["val/loss"], s["unigram_baseline"]
    return Result("charlm GPT learns (60 steps, CPU)", "pass" if loss < base else "fail",
                  f"val/loss {loss:.3f} vs unigram baseline {base:.3f}; {s['tokens_per_sec']:,.0f} tokens/s")


def check_cpu_bf16(tmp: Path) -> Result:
    import torch

    from lit_speed.precision.probe import cpu_has_native_bf16, measure_slowdown

    ratio = measure_slowdown(torch.bfloat16)
    native = cpu_has_native_bf16()
    advice = "bf16-mixed can pay off here" if native and ratio < 1.5 else "stay with 32-true on this CPU"
    return Result("CPU bf16 matmul (information)", "pass",
                  f"native bf16 kernels: {native}; bf16 matmul takes x{ratio:.2f} the fp32 time: {advice}")


def _precision_speedup(mode: str, tmp: Path) -> Result:
    """Steady-state tokens/s of ``mode`` against 32-true at a size where a GPU's arithmetic is the cost (GPU_GPT):
    the 0.8M laptop GPT is launch-bound on a GPU, where autocast's extra casts make any low precision slower."""
    fp32 = train(GPU_GPT + ["trainer=gpu", "precision=32-true"], tmp / "fp32")
    low = train(GPU_GPT + ["trainer=gpu", f"precision={mode}"], tmp / mode)
    ok, words = speedup_verdict(fp32["steady_tokens_per_sec"], low["steady_tokens_per_sec"])
    finite = math.isfinite(low["final_val"]["val/loss"])
    return Result(f"{mode} faster than 32-true (CUDA)", "pass" if ok and finite else "fail",
                  f"{words}; {GPU_GPT_WORDS}" + ("" if finite else "; val/loss is not finite"))


def check_bf16_gpu(tmp: Path) -> Result:
    return _precision_speedup("bf16-mixed", tmp)


def check_fp16_gpu(tmp: Path) -> Result:
    return _precision_speedup("16-mixed", tmp)


def check_nvml(tmp: Path) -> Result:
    train(CHARLM + ["trainer=gpu", "callbacks=[device_stats]", "logger=csv", "trainer.log_every_n_steps=10"], tmp / "nvml")
    files = list((tmp / "nvml").rglob("metrics.csv"))
    rows = list(csv.DictReader(files[0].open())) if files else []
    values = [float(r["stats/gpu_util_pct"]) for r in rows if r.get("stats/gpu_util_pct")]
    return Result("NVML stats logged (stats/gpu_util_pct)", "pass" if values else "fail",
                  f"{len(values)} logged values, max {max(values):.0f} %" if values else "no stats/gpu_util_pct in metrics.csv")


def check_zero_offload_gpu(tmp: Path) -> Result:
    s = train(CHARLM + ["trainer=gpu", "strategy=zero2_offload", "optimizer=cpu_adam"], tmp / "zero")
    loss = s["final_val"]["val/loss"]
    ok = math.isfinite(loss) and loss < s["unigram_baseline"]
    return Result("ZeRO-2 + optimizer offload (CUDA)", "pass" if ok else "fail",
                  f"val/loss {loss:.3f} vs unigram {s['unigram_baseline']:.3f}")


CPU_CHECKS: list[Callable[[Path], Result]] = [check_default_run, check_charlm_cpu, check_cpu_bf16]
GPU_CHECKS: dict[str, Callable[[Path], Result]] = {
    "bf16-mixed faster than 32-true (CUDA)": check_bf16_gpu,
    "16-mixed faster than 32-true (CUDA)": check_fp16_gpu,
    "NVML stats logged (stats/gpu_util_pct)": check_nvml,
    "ZeRO-2 + optimizer offload (CUDA)": check_zero_offload_gpu,
}


def run_checks(gpu: bool, cuda_available: bool) -> list[Result]:
    results = []
    if gpu and not cuda_available:
        return [Result(name, "not run", "no CUDA device visible (torch.cuda.is_available() is False); "
                                        "run on a machine with an NVIDIA GPU and a CUDA build of torch") for name in GPU_CHECKS]
    checks = list(GPU_CHECKS.values()) if gpu else CPU_CHECKS
    with tempfile.TemporaryDirectory(prefix="lit_speed_selfcheck_") as tmp:
        for check in checks:
            try:
                results.append(check(Path(tmp)))
            except Exception as error:  # noqa: BLE001 - a crashing check is a failed check, reported in the table
                results.append(Result(check.__name__.removeprefix("check_"), "fail", f"{type(error).__name__}: {error}"))
    return results


def print_results(results: list[Result]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="lit_speed selfcheck", title_justify="left")
    for column in ("check", "result", "detail"):
        table.add_column(column)
    colour = {"pass": "green", "fail": "red", "not run": "yellow"}
    for r in results:
        table.add_row(r.name, f"[{colour[r.status]}]{r.status}[/]", r.detail)
    Console(soft_wrap=True).print(table)


def no_cuda_line() -> str:
    """The one line ``--gpu --table`` prints on a machine without a usable CUDA device."""
    import torch

    build = f"torch {torch.__version__} is built without CUDA" if torch.version.cuda is None else \
        f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no device"
    return (f"selfcheck --gpu --table: no CUDA device (torch.cuda.is_available() is False; {build}); "
            "nothing measured, run it on a machine with an NVIDIA GPU")


@contextmanager
def environment_restored() -> Iterator[None]:
    """Put ``os.environ`` back as it was on leaving. Lightning's in-process fits set MASTER_ADDR/MASTER_PORT (and
    DeepSpeed RANK, WORLD_SIZE, ...) for a process group that stays alive; a check's training process inheriting
    them tries to listen on that same port (EADDRINUSE, seen on an H200 on 2026-11-27)."""
    before = dict(os.environ)
    try:
        yield
    finally:
        for key in set(os.environ) - set(before):
            del os.environ[key]
        os.environ.update(before)


def run_table(out_dir: Path, budget_s: float) -> int:
    """Measure the GPU table, run the GPU checks, print both with the verdicts, write JSON + markdown."""
    import time

    from selfcheck_table import machine, measure_all

    from lit_speed.reporting.gpu_table import plan_cells, verdicts, write_report

    meta = machine()
    print(" | ".join(f"{k}: {v}" for k, v in meta.items()), flush=True)
    with environment_restored():  # the in-process ZeRO cells leave MASTER_PORT & co. set for a live process group
        cells = measure_all(plan_cells(), deadline=time.monotonic() + budget_s,
                            log=lambda line: print(line, flush=True))
    results = run_checks(gpu=True, cuda_available=True)
    lines = verdicts(cells)
    json_path, md_path = write_report(out_dir, cells, lines, [vars(r) for r in results], meta)
    print(md_path.read_text())
    print_results(results)
    print(f"written: {json_path} and {md_path}")
    return exit_code(results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="run the GPU-only checks (needs a CUDA device)")
    parser.add_argument("--table", action="store_true", help="with --gpu: also measure the tokens/s and memory table")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "selfcheck_gpu",
                        help="folder for gpu_table.json and gpu_table.md (--table)")
    parser.add_argument("--budget-s", type=float, default=300.0,
                        help="seconds for the table's cells (--table); the checks take ~3 more minutes")
    args = parser.parse_args(argv)
    if args.table and not args.gpu:
        parser.error("--table measures on a GPU: use it as --gpu --table")
    os.environ.setdefault("LIT_SPEED_ROOT", str(ROOT))
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import torch

    from lit_speed.strategies.ds_accelerator import default_accelerator_name

    # the subprocesses' default; ZeroStrategy picks the accelerator from the device at setup anyway
    os.environ.setdefault("DS_ACCELERATOR", default_accelerator_name())
    if args.table:
        if not torch.cuda.is_available():
            print(no_cuda_line(), file=sys.stderr)
            return 1
        return run_table(args.out, args.budget_s)
    results = run_checks(args.gpu, torch.cuda.is_available())
    print_results(results)
    code = exit_code(results)
    if args.gpu and not torch.cuda.is_available():
        print("--gpu: no CUDA device here, so nothing was checked (exit 1). Without --gpu the CPU checks run.",
              file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
