"""scripts/selfcheck.py: verdict logic, the --gpu refusal on CPU machines, and the real checks where they can run."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("selfcheck", ROOT / "scripts" / "selfcheck.py")
selfcheck = importlib.util.module_from_spec(spec)
sys.modules["selfcheck"] = selfcheck  # dataclasses look their module up there
spec.loader.exec_module(selfcheck)
Result = selfcheck.Result


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
