"""The README's launch paths, launched: torchrun with 2 processes, an Optuna sweep, a submitit-local sweep. Slow tier.

Each checks what a user looks at afterwards: one run folder with one ``summary.json`` (torchrun), and the
sweep report of a multirun (``sweep_report.md`` / ``.csv`` with one row per job).
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lit_speed.run.launch_env import RUN_TIME_ENV, free_port
from tests.helpers.repo import ROOT, run_train_script

TINY = ["trainer.max_epochs=1", "trainer.limit_train_batches=4", "trainer.limit_val_batches=2", "logger=none",
        "callbacks=none", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


def _sweep_rows(sweep_dir: Path) -> list[dict]:
    with open(sweep_dir / "sweep_report.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
def test_torchrun_two_processes_write_one_run_folder_with_one_summary(tmp_path):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "HYDRA_FULL_ERROR": "0", "PYTHONPATH": str(ROOT)}
    env.pop(RUN_TIME_ENV, None)
    # rank 1 starts 2 s after rank 0, so a ${now:...} resolved per rank would name another folder
    launcher = tmp_path / "late_rank_1.py"
    launcher.write_text("import os, runpy, sys, time\n"
                        "time.sleep(2.0 if os.environ['RANK'] == '1' else 0.0)\n"
                        f"sys.argv[0] = {str(ROOT / 'scripts' / 'train.py')!r}\n"
                        "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    cmd = ["torchrun", "--standalone", "--nproc_per_node", "2", str(launcher),
           "trainer=ddp_cpu", f"paths.log_dir={tmp_path / 'logs'}", *TINY]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = sorted((tmp_path / "logs" / "train" / "runs").iterdir())
    assert len(runs) == 1, f"ranks disagreed on the run folder: {runs}"
    summaries = list((tmp_path / "logs").rglob("summary.json"))
    assert summaries == [runs[0] / "summary.json"]
    summary = json.loads(summaries[0].read_text())
    assert "2 process(es)" in summary["startup"]["effective batch"]
    assert summary["global_step"] == 4


@pytest.mark.slow
def test_optuna_multirun_writes_its_sweep_report(tmp_path):
    proc = run_train_script(["-m", "hparams_search=optuna", "hydra.sweeper.n_trials=2",
                             "hydra.sweeper.sampler.n_startup_trials=2", f"hydra.sweep.dir={tmp_path}", *TINY],
                            timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "optimization_results.yaml").exists()  # the sweeper's own result
    rows = _sweep_rows(tmp_path)
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert all("optimizer.lr=" in r["variation"] and r["monitor"] == "val/acc" and r["final_val"] for r in rows)
    assert "2 job(s), 0 failed." in (tmp_path / "sweep_report.md").read_text()
    assert {json.loads((tmp_path / str(i) / "summary.json").read_text())["global_step"] for i in range(2)} == {4}


@pytest.mark.slow
def test_submitit_local_multirun_writes_its_sweep_report(tmp_path):
    proc = run_train_script(["-m", "hydra/launcher=local_zero", "hydra.launcher.timeout_min=10",
                             "optimizer.lr=1e-3,3e-3", f"hydra.sweep.dir={tmp_path}", *TINY], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _sweep_rows(tmp_path)
    assert [(r["variation"], r["status"]) for r in rows] == [("optimizer.lr=0.001", "ok"), ("optimizer.lr=0.003", "ok")]
    assert "2 job(s), 0 failed." in (tmp_path / "sweep_report.md").read_text()
    lrs = {json.loads((tmp_path / str(i) / "summary.json").read_text())["config"]["optimizer"]["lr"] for i in range(2)}
    assert lrs == {1e-3, 3e-3}


def test_the_entry_point_releases_the_process_group_it_leaves():
    """Lightning keeps the group after fit; scripts/train.py destroys it before exit (gloo threads left to the
    interpreter's static destructors aborted a finished 2-process ZeRO run, exit -6, 1 time in ~14). In a process of
    its own: this one may hold a group other tests made."""
    code = ("import os, torch.distributed as dist\n"
            "from lit_speed.run.process_end import release_process_group\n"
            "release_process_group()\n"  # no group: nothing to do
            f"os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='{free_port()}')\n"
            "dist.init_process_group('gloo', rank=0, world_size=1)\n"
            "before = dist.is_initialized()\n"
            "release_process_group()\n"
            "print(before, dist.is_initialized())\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "False"]
