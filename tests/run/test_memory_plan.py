"""``scripts/plan.py`` plans what ``scripts/train.py`` would run for the same overrides, presets included (issue 25)."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from lit_speed.run.config_check import preflight
from lit_speed.run.memory_fit.memory_plan import configured_run, usable_micro_batches
from tests.helpers.repo import ROOT


def test_the_configured_run_is_read_from_the_composed_config() -> None:
    run = configured_run(preflight([]))
    assert (run.precisions, run.micro_batch, run.strategy, run.world_size, run.checkpointing, run.callbacks) == \
        (["32-true"], 64, "auto", 1, False, ["default"])
    fast = configured_run(preflight(["experiment=charlm_fast"]))
    assert fast.precisions == ["32-true", "bf16-master", "bf16-mixed"]  # precision=auto: the modes it times
    assert (fast.micro_batch, fast.strategy, fast.callbacks) == (12, "auto", ["validation_budget"])  # the preset's
    zero = configured_run(preflight(["strategy=zero2_offload", "trainer.devices=2", "callbacks=[default,compile]"]))
    assert (zero.strategy, zero.world_size, zero.callbacks) == ("zero2_offload", 2, ["default", "compile"])
    assert configured_run(preflight(["callbacks=[default,activation_checkpointing]"])).checkpointing


def test_micro_batches_the_accumulation_schedule_cannot_divide_are_left_out() -> None:
    cfg = preflight(["experiment=charlm_fast"])  # effective batch 12 -> 24, ramp: step
    kept, notes = usable_micro_batches(cfg, [4, 8, 12, 16], world_size=1)
    assert kept == [4, 12] and "8, 16 left out" in notes[0]
    assert usable_micro_batches(cfg, [2, 4, 6, 12], world_size=2)[0] == [2, 6]  # x 2 processes: 4 and 12 do not
    assert usable_micro_batches(preflight([]), [3, 5], world_size=1) == ([3, 5], [])  # no schedule: all kept


def _plan(*argv: str) -> str:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "plan.py"), *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_plan_of_optimizer_muon_asks_muon_for_its_state() -> None:
    out = _plan("optimizer=muon", "--micro-batches", "64", "--precisions", "32-true")
    # Muon's one momentum buffer (4 bytes) on the hidden matrices, AdamW's two (8 bytes) elsewhere
    assert re.search(r"MuonAdamW keeps [4-7]\.\d\d bytes of state per float32 parameter \(declared\)", out), out[-2000:]
    assert re.search(r"^#1: python scripts/train.py optimizer=muon precision=32-true data.batch_size=64$", out, re.M)
    assert re.search(r"│\s+1\* │ 32-true", out)  # the configured run, marked


def test_plan_of_the_charlm_fast_preset_plans_its_own_run() -> None:
    out = _plan("experiment=charlm_fast", "--checkpoint", "")
    assert "MuonAdamW keeps" in out and "micro-batches 8, 16, 32 left out" in out
    starred = re.findall(r"│\s+\d+\* │ (\S+)\s+│\s+no │\s+(\d+) │ auto", out)
    assert sorted(starred) == [("32-true", "12"), ("bf16-mast…", "12"), ("bf16-mixed", "12")], out[-3000:]
    assert "precision 32-true or bf16-master or bf16-mixed (precision=auto picks one" in out
    commands = re.findall(r"^#\d+: (python scripts/train.py .*)$", out, flags=re.M)
    assert commands and all(c.startswith("python scripts/train.py experiment=charlm_fast precision=") for c in commands)


@pytest.mark.parametrize("argv, message", [
    (["strategy=zero1", "strategy.offload_optimizer=true", "optimizer=cpu_adam"],
     r"Config error: strategy: the planner has no option for ZeroLayout\(stage=1, offload_optimizer=True"),
])
def test_a_layout_no_option_plans_is_refused(argv, message) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "plan.py"), *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2 and re.search(message, done.stderr), done.stderr[-2000:]
