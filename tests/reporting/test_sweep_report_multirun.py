"""Acceptance: a real ``-m`` sweep of scripts/train.py writes a report whose content matches the jobs' summaries."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_sweep(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/train.py", "-m", *overrides, "callbacks=none", "logger=none",
                           "trainer.enable_progress_bar=false", f"hydra.sweep.dir={tmp_path}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)


@pytest.mark.slow  # 4 training processes: ~60-90 s on a shared 2-core CPU (mostly imports)
def test_precision_by_accumulation_sweep_report(tmp_path: Path) -> None:
    proc = run_sweep(tmp_path, "precision=32-true,bf16-mixed", "accumulation=none,ramp", "trainer.max_steps=50")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = [json.loads((tmp_path / str(n) / "summary.json").read_text()) for n in range(4)]
    with (tmp_path / "sweep_report.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["variation"] for r in rows] == [
        "precision=32-true accumulation=none", "precision=32-true accumulation=ramp",
        "precision=bf16-mixed accumulation=none", "precision=bf16-mixed accumulation=ramp"]
    base = summaries[0]["samples_per_sec"]
    for row, s in zip(rows, summaries):
        assert row["status"] == "ok"
        assert float(row["samples_per_sec"]) == s["samples_per_sec"]
        assert float(row["diff_pct"]) == round(100 * (s["samples_per_sec"] / base - 1), 1)
        assert float(row["peak_rss_mib"]) == round(s["peak_rss_bytes"] / 2**20, 1)
        assert float(row["final_train_loss"]) == s["final_train_loss"]
        assert float(row["best_val"]) == s["best_val"]
        assert float(row["final_val"]) == s["final_val"]["val/acc"]
    md = (tmp_path / "sweep_report.md").read_text()
    assert "Every job: `trainer.max_steps=50 callbacks=none logger=none" in md
    assert "| 0 | `precision=32-true accumulation=none` | " in md and "| baseline |" in md
    assert f"| {summaries[3]['best_val']:.4f} | {summaries[3]['final_val']['val/acc']:.4f} |" in md
    assert "4 job(s), 0 failed." in md
    assert matplotlib.image.imread(tmp_path / "sweep_report.png").ndim == 3


@pytest.mark.slow  # 2 training processes
def test_failed_job_is_a_row_not_dropped(tmp_path: Path) -> None:
    proc = run_sweep(tmp_path, "data.batch_size=32,0", "trainer.max_steps=5")
    assert proc.returncode != 0  # Hydra re-raises the failed job's error after the batch
    with (tmp_path / "sweep_report.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["variation"], r["status"]) for r in rows] == [("data.batch_size=32", "ok"),
                                                             ("data.batch_size=0", "failed")]
    assert "batch_size" in rows[1]["error"]
    assert "| 1 | `data.batch_size=0` | **failed** |" in (tmp_path / "sweep_report.md").read_text()
