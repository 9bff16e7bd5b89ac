"""scripts/selfcheck.py: verdict logic, the --gpu refusal on CPU machines, and the real checks where they can run."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("selfcheck", ROOT / "scripts" / "selfcheck.py")
selfcheck = importlib.util.module_from_spec(spec)
sys.modules["selfcheck"] = selfcheck  # dataclasses look their module up there
spec.loader.exec_module(selfcheck)
Result = selfcheck.Result


def table_module():
    """scripts/selfcheck_table.py, imported as selfcheck.py imports it."""
    spec_t = importlib.util.spec_from_file_location("selfcheck_table", ROOT / "scripts" / "selfcheck_table.py")
    table = importlib.util.module_from_spec(spec_t)
    spec_t.loader.exec_module(table)
    return table


def test_speedup_verdict_needs_more_than_noise() -> None:
    assert selfcheck.speedup_verdict(1000.0, 1500.0) == (True, "x1.50 tokens/s vs 32-true (pass needs >= x1.05)")
    assert selfcheck.speedup_verdict(1000.0, 1020.0)[0] is False  # 2 % is noise, not a speed-up
    assert selfcheck.speedup_verdict(1000.0, 400.0)[0] is False


def test_exit_code_requires_a_check_that_ran_and_no_failure() -> None:
    assert selfcheck.exit_code([Result("a", "pass", ""), Result("b", "pass", "")]) == 0
    assert selfcheck.exit_code([Result("a", "pass", ""), Result("b", "fail", "")]) == 1
    assert selfcheck.exit_code([Result("a", "not run", "no CUDA")]) == 1  # nothing verified is not a pass
    assert selfcheck.exit_code([]) == 1


def test_gpu_checks_without_cuda_are_listed_as_not_run() -> None:
    results = selfcheck.run_checks(gpu=True, cuda_available=False)
    assert [r.name for r in results] == list(selfcheck.GPU_CHECKS)
    assert {r.status for r in results} == {"not run"}
    assert all("no CUDA device visible" in r.detail for r in results)


def test_a_crashing_check_is_a_failed_row(monkeypatch: pytest.MonkeyPatch) -> None:
    def check_broken(tmp: Path) -> Result:
        raise RuntimeError("summary.json missing")

    monkeypatch.setattr(selfcheck, "CPU_CHECKS", [check_broken])
    assert selfcheck.run_checks(gpu=False, cuda_available=False) == [
        Result("broken", "fail", "RuntimeError: summary.json missing")]


HYDRA_STDERR = """Error executing job with overrides: ['strategy=zero2_offload']
Traceback (most recent call last):
  File "scripts/train.py", line 12, in main
    raise ValueError("optimizer=cpu_adam: ...")
ValueError: optimizer=cpu_adam needs the CPU Adam build (run it once with DS_BUILD_CPU_ADAM=1)

Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.
"""


def test_a_failed_run_reports_its_error_line_not_hydras_closing_hint() -> None:
    assert selfcheck.error_line(HYDRA_STDERR, 1) == (
        "ValueError: optimizer=cpu_adam needs the CPU Adam build (run it once with DS_BUILD_CPU_ADAM=1)")
    assert selfcheck.error_line("killed\n", 137) == "killed"
    assert selfcheck.error_line("", -9) == "exit -9"


@pytest.mark.slow  # 10-28 s: the default tier stays near 10 minutes on 2 cores
def test_a_failed_training_process_keeps_its_stderr(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError) as raised:
        selfcheck.train(["no_such_group=1"], tmp_path / "run")
    assert "no_such_group" in str(raised.value)
    assert "HYDRA_FULL_ERROR" not in str(raised.value).split(" (stderr:")[0]
    assert "no_such_group" in (tmp_path / "run" / "stderr.txt").read_text()


def test_the_table_leaves_no_process_group_variables_to_the_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """What an in-process fit sets (MASTER_PORT of a live group) is gone before the checks' processes start."""
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")  # the user's own, kept
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with selfcheck.environment_restored():
        os.environ["MASTER_PORT"] = "57159"
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    assert "MASTER_PORT" not in os.environ and os.environ["MASTER_ADDR"] == "10.0.0.1"


def test_the_gpu_precision_checks_run_the_table_size_gpt(tmp_path: Path) -> None:
    """The overrides compose into the 12-layer, 768-wide GPT at context 256 and micro-batch 8."""
    from tests.helpers.repo import compose_config

    cfg = compose_config(selfcheck.GPU_GPT + ["trainer=gpu", "precision=bf16-mixed"], tmp_path)
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd, cfg.model.block_size) == (12, 12, 768, 256)
    assert cfg.data.batch_size == 8 and cfg.trainer.accelerator == "gpu"
    table = table_module()  # the same GPT as the --table's cells
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd) == tuple(table.GPT_SIZE.values())
    assert cfg.model.block_size == table.BLOCK


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour on a machine without CUDA")
def test_gpu_flag_on_cpu_machine_exits_nonzero_with_reason() -> None:
    proc = subprocess.run([sys.executable, "scripts/selfcheck.py", "--gpu"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1
    assert "not run" in proc.stdout and "no CUDA device here, so nothing was checked" in proc.stderr


@pytest.mark.slow  # three training processes (~1-2 min on 2 cores)
def test_cpu_checks_pass_here() -> None:
    proc = subprocess.run([sys.executable, "scripts/selfcheck.py"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert proc.stdout.count("pass") >= 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: runs the GPU-only selfcheck")
def test_gpu_checks_pass_on_a_gpu() -> None:
    proc = subprocess.run([sys.executable, "scripts/selfcheck.py", "--gpu"], cwd=ROOT, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


# -- the --table report: pure parts (the measuring needs a GPU) -------------------------------------------------
from lit_speed.reporting.gpu_table import Cell, plan_cells, verdicts, write_report  # noqa: E402

GIB = 1024 ** 3


def measured(tokens: dict, peak: dict, status: dict | None = None) -> list[Cell]:
    """The planned cells with the given tokens/s and peak GiB per label (absent labels: not run)."""
    cells = plan_cells()
    for c in cells:
        if c.label in tokens:
            c.tokens_per_sec, c.peak_allocated_bytes, c.status = tokens[c.label], int(peak[c.label] * GIB), "ok"
        c.status = (status or {}).get(c.label, c.status)
    return cells


def test_plan_puts_the_precision_grid_first_then_checkpointing_then_zero() -> None:
    cells = plan_cells()
    assert [c.group for c in cells] == ["precision"] * 16 + ["checkpointing"] + ["zero"] * 6
    assert {(c.precision, c.micro_batch) for c in cells[:16]} == {
        (p, m) for p in ("32-true", "tf32", "bf16-mixed", "16-mixed") for m in (1, 2, 4, 8)}
    assert [c.label for c in cells[16:19]] == ["bf16-mixed, micro-batch 8, activation checkpointing",
                                              "bf16-mixed, micro-batch 8, ZeRO-1",
                                              "bf16-mixed, micro-batch 8, ZeRO-1 + offload"]


def test_one_verdict_line_per_technique_with_ratios_against_its_baseline() -> None:
    tokens = {"32-true, micro-batch 8": 10_000, "tf32, micro-batch 8": 20_000, "bf16-mixed, micro-batch 8": 40_000,
              "16-mixed, micro-batch 8": 38_000, "bf16-mixed, micro-batch 1": 8_000,
              "bf16-mixed, micro-batch 8, activation checkpointing": 30_000,
              "bf16-mixed, micro-batch 8, ZeRO-2": 36_000, "bf16-mixed, micro-batch 8, ZeRO-2 + offload": 10_000}
    peak = {"32-true, micro-batch 8": 8.0, "tf32, micro-batch 8": 8.0, "bf16-mixed, micro-batch 8": 6.0,
            "16-mixed, micro-batch 8": 6.0, "bf16-mixed, micro-batch 1": 2.0,
            "bf16-mixed, micro-batch 8, activation checkpointing": 3.0,
            "bf16-mixed, micro-batch 8, ZeRO-2": 5.0, "bf16-mixed, micro-batch 8, ZeRO-2 + offload": 1.5}
    lines = verdicts(measured(tokens, peak, {"bf16-mixed, micro-batch 8, ZeRO-3": "oom"}))
    assert lines[:5] == [
        "tf32: x2.00 tokens/s, peak memory x1.00 vs 32-true (micro-batch 8)",
        "bf16-mixed: x4.00 tokens/s, peak memory x0.75 vs 32-true (micro-batch 8)",
        "16-mixed: x3.80 tokens/s, peak memory x0.75 vs 32-true (micro-batch 8)",
        "micro-batch 8: x5.00 tokens/s, peak memory x3.00 vs micro-batch 1 (bf16-mixed)",
        "activation checkpointing: x0.75 tokens/s, peak memory x0.50 vs no checkpointing (bf16-mixed, micro-batch 8)"]
    assert "ZeRO-2: x0.90 tokens/s, peak memory x0.83 vs no ZeRO (bf16-mixed, micro-batch 8)" in lines
    assert "ZeRO-2 + offload: x0.25 tokens/s, peak memory x0.25 vs no ZeRO (bf16-mixed, micro-batch 8)" in lines
    assert "ZeRO-3: no comparison (ZeRO-3 oom)" in lines
    assert "ZeRO-1: no comparison (ZeRO-1 not run)" in lines
    assert len(lines) == 3 + 1 + 1 + 6


def test_precision_verdict_uses_the_largest_micro_batch_both_sides_fit() -> None:
    tokens = {"32-true, micro-batch 4": 1000, "bf16-mixed, micro-batch 4": 3000, "bf16-mixed, micro-batch 8": 5000}
    peak = {k: 1.0 for k in tokens}
    lines = verdicts(measured(tokens, peak, {"32-true, micro-batch 8": "oom"}))
    assert "bf16-mixed: x3.00 tokens/s, peak memory x1.00 vs 32-true (micro-batch 4)" in lines
    assert "tf32: no comparison (tf32 not run)" in lines


def test_report_is_written_as_json_and_markdown(tmp_path: Path) -> None:
    import json

    cells = measured({"32-true, micro-batch 1": 1234.5}, {"32-true, micro-batch 1": 1.5},
                     {"16-mixed, micro-batch 8": "skipped: time budget spent"})
    checks = [{"name": "NVML stats logged (stats/gpu_util_pct)", "status": "pass", "detail": "12 logged values"}]
    meta = {"gpu": "NVIDIA H100 80GB HBM3 (79 GiB)", "commit": "abc123"}
    json_path, md_path = write_report(tmp_path / "out", cells, ["bf16-mixed: x2.00"], checks, meta)
    payload = json.loads(json_path.read_text())
    assert payload["meta"] == meta and payload["checks"] == checks and payload["verdicts"] == ["bf16-mixed: x2.00"]
    first = payload["cells"][0]
    assert (first["label"], first["tokens_per_sec"], first["peak_allocated_bytes"]) == (
        "32-true, micro-batch 1", 1234.5, int(1.5 * GIB))
    md = md_path.read_text()
    assert "gpu: NVIDIA H100 80GB HBM3 (79 GiB) | commit: abc123" in md
    assert "| precision | 32-true, micro-batch 1 | 1,234 | 1.50 | ok |" in md
    assert "| precision | 16-mixed, micro-batch 8 | - | - | skipped: time budget spent |" in md
    assert "- bf16-mixed: x2.00" in md and "| NVML stats logged (stats/gpu_util_pct) | pass | 12 logged values |" in md


def test_table_measuring_module_imports_and_feeds_whole_windows() -> None:
    table = table_module()
    x, y = table.RandomTokens(batches=2, micro_batch=4)[1]
    assert x.shape == y.shape == (4, table.BLOCK) and torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < table.VOCAB


def test_the_timed_window_holds_min_steps_and_min_seconds_then_stops_the_fit() -> None:
    """The table's timing logic on CPU: a step that sleeps 50 ms, a 0.3 s window after 2 warm-up steps."""
    import time as time_module

    import lightning.pytorch as pl

    table = table_module()

    class Sleepy(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, batch_idx):
            time_module.sleep(0.05)
            return (self.w - 1).pow(2).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    syncs = []
    window = table.TimedWindow(2, min_steps=3, min_seconds=0.3, sync=lambda: syncs.append(1))
    trainer = pl.Trainer(accelerator="cpu", max_steps=1000, callbacks=[window], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Sleepy(), torch.utils.data.DataLoader(table.RandomTokens(4, 1, length=1000), batch_size=None))
    assert window.seconds >= 0.3 and window.steps >= 3
    assert trainer.global_step == 2 + window.steps < 30  # stopped by the window, not by max_steps
    assert len(syncs) == 2  # at the window's start and at its end, not every step


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour on a machine without CUDA")
def test_gpu_table_on_cpu_machine_says_so_in_one_line_and_exits_1() -> None:
    proc = subprocess.run([sys.executable, "scripts/selfcheck.py", "--gpu", "--table"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device (torch.cuda.is_available() is False" in lines[0], proc.stderr
