"""Sweep report functional core, the Hydra callback and TimeToTarget, on synthetic sweep folders (fast)."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import matplotlib.image
import pytest
import yaml
from hydra.core.utils import JobReturn, JobStatus
from hydra.types import RunMode
from omegaconf import OmegaConf

from lit_speed.reporting import SweepReportCallback, TimeToTarget, build_rows, target_met, write_report
from lit_speed.reporting.sweep_report import ERROR_FILE, common_overrides, find_job_dirs, load_job


def make_job(sweep: Path, num: int, overrides: list[str], summary: dict | None) -> Path:
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if summary is not None:
        (job / "summary.json").write_text(json.dumps(summary))
    return job


def summary(samples_per_sec: float, peak_mib: float, loss: float, best: float, final: float,
            tokens_per_sec: float | None = None, components: dict | None = None) -> dict:
    return {"samples_per_sec": samples_per_sec, "tokens_per_sec": tokens_per_sec,
            "peak_rss_bytes": int(peak_mib * 2**20), "final_train_loss": loss, "monitor": "val/loss",
            "best_val": best, "final_val": {"val/loss": final}, "fit_wall_time_s": 3.0, "global_step": 50,
            "components": components or {}}


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    make_job(tmp_path, 0, ["precision=32-true", "trainer.max_steps=50"], summary(100.0, 400, 2.5, 2.4, 2.41))
    make_job(tmp_path, 1, ["precision=bf16-mixed", "trainer.max_steps=50"], summary(80.0, 380, 2.6, 2.5, 2.52))
    make_job(tmp_path, 2, ["precision=16-mixed", "trainer.max_steps=50"], None)  # failed job
    # job 10 must sort after job 2 (numeric, not lexical, order)
    make_job(tmp_path, 10, ["precision=bf16-true", "trainer.max_steps=50"], summary(125.0, 300, 2.9, 2.8, 2.81))
    return tmp_path


def test_rows_follow_summaries_in_job_order(sweep: Path) -> None:
    rows = build_rows([load_job(d) for d in find_job_dirs(sweep)])
    assert [r["job"] for r in rows] == ["0", "1", "2", "10"]
    assert [r["status"] for r in rows] == ["ok", "ok", "failed", "ok"]
    assert [r["variation"] for r in rows] == ["precision=32-true", "precision=bf16-mixed", "precision=16-mixed",
                                              "precision=bf16-true"]
    # diff % against the first row: 80/100 - 1 = -20 %, 125/100 - 1 = +25 %
    assert [r["diff_pct"] for r in rows] == [0.0, -20.0, None, 25.0]
    assert [r["peak_rss_mib"] for r in rows] == [400.0, 380.0, None, 300.0]
    assert rows[1]["final_train_loss"] == 2.6 and rows[1]["best_val"] == 2.5 and rows[1]["final_val"] == 2.52
    assert "no summary.json" in rows[2]["error"]


def test_baseline_is_first_finished_job_and_tokens_unit_when_all_count_tokens(tmp_path: Path) -> None:
    make_job(tmp_path, 0, ["a=1"], None)
    make_job(tmp_path, 1, ["a=2"], summary(10.0, 1, 1.0, 1.0, 1.0, tokens_per_sec=640.0))
    make_job(tmp_path, 2, ["a=3"], summary(20.0, 1, 1.0, 1.0, 1.0, tokens_per_sec=960.0))
    rows = build_rows([load_job(d) for d in find_job_dirs(tmp_path)])
    assert rows[1]["throughput_unit"] == "tokens/s" and rows[1]["throughput"] == 640.0
    assert rows[1]["diff_pct"] == 0.0 and rows[2]["diff_pct"] == 50.0  # 960/640 - 1


def test_samples_unit_when_any_job_lacks_tokens(tmp_path: Path) -> None:
    make_job(tmp_path, 0, ["a=1"], summary(10.0, 1, 1.0, 1.0, 1.0, tokens_per_sec=640.0))
    make_job(tmp_path, 1, ["a=2"], summary(20.0, 1, 1.0, 1.0, 1.0))
    rows = build_rows([load_job(d) for d in find_job_dirs(tmp_path)])
    assert {r["throughput_unit"] for r in rows} == {"samples/s"}
    assert rows[1]["diff_pct"] == 100.0


def test_common_overrides_are_factored_out(sweep: Path) -> None:
    jobs = [load_job(d) for d in find_job_dirs(sweep)]
    assert common_overrides(jobs) == ["trainer.max_steps=50"]
    assert common_overrides(jobs[:1]) == []  # a single job keeps all of its overrides as its variation


def test_write_report_files_match_summaries(sweep: Path) -> None:
    paths = write_report(sweep)
    md = paths["md"].read_text()
    assert "Every job: `trainer.max_steps=50`" in md
    assert "| 0 | `precision=32-true` | 100 | baseline | 400 | 2.5000 | 2.4000 | 2.4100 |" in md
    assert "| 1 | `precision=bf16-mixed` | 80 | -20.0 % | 380 | 2.6000 | 2.5000 | 2.5200 |" in md
    assert "| 2 | `precision=16-mixed` | **failed** |" in md
    assert "4 job(s), 1 failed." in md
    with paths["csv"].open() as f:
        table = list(csv.DictReader(f))
    assert [row["status"] for row in table] == ["ok", "ok", "failed", "ok"]
    assert float(table[3]["throughput"]) == 125.0 and float(table[3]["diff_pct"]) == 25.0
    image = matplotlib.image.imread(paths["png"])
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 500


def test_time_to_target_column_from_components(tmp_path: Path) -> None:
    reached = {"TimeToTarget": {"target": 2.5, "reached": True, "time_to_target_s": 12.5, "target_step": 300}}
    missed = {"TimeToTarget": {"target": 2.5, "reached": False, "time_to_target_s": None, "target_step": None}}
    make_job(tmp_path, 0, ["a=1"], summary(1.0, 1, 1.0, 1.0, 1.0, components=reached))
    make_job(tmp_path, 1, ["a=2"], summary(1.0, 1, 1.0, 1.0, 1.0, components=missed))
    md = write_report(tmp_path)["md"].read_text()
    assert "time to target (s)" in md
    assert "| 12.5 (step 300) |" in md and "| not reached |" in md


def test_no_time_to_target_column_without_measurement(sweep: Path) -> None:
    assert "time to target" not in write_report(sweep)["md"].read_text()


def test_missing_sweep_dir_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="is not a folder; pass the folder Hydra printed"):
        write_report(tmp_path / "nope")


def hydra_config(sweep: Path, job_dir: Path, mode: RunMode = RunMode.MULTIRUN):
    return OmegaConf.create({"hydra": {"mode": mode, "sweep": {"dir": str(sweep)},
                                       "runtime": {"output_dir": str(job_dir)}}})


def test_callback_records_a_failed_job_and_writes_after_each_job(tmp_path: Path) -> None:
    make_job(tmp_path, 0, ["a=1"], summary(10.0, 1, 1.0, 1.0, 1.0))
    failed = make_job(tmp_path, 1, ["a=2"], None)
    ret = JobReturn(overrides=["a=2"], status=JobStatus.FAILED)
    ret.return_value = ValueError("data.batch_size must be >= 1, got 0")
    SweepReportCallback().on_job_end(hydra_config(tmp_path, failed), ret)
    assert (failed / ERROR_FILE).read_text().strip() == "ValueError: data.batch_size must be >= 1, got 0"
    md = (tmp_path / "sweep_report.md").read_text()
    assert "| 1 | `a=2` | **failed** |" in md and "data.batch_size must be >= 1, got 0" in md


def test_callback_ignores_single_runs_and_can_be_disabled(tmp_path: Path) -> None:
    job = make_job(tmp_path, 0, ["a=1"], summary(10.0, 1, 1.0, 1.0, 1.0))
    ok = JobReturn(overrides=["a=1"], status=JobStatus.COMPLETED)
    SweepReportCallback().on_job_end(hydra_config(tmp_path, job, RunMode.RUN), ok)
    SweepReportCallback(enabled=False).on_multirun_end(hydra_config(tmp_path, job))
    assert not (tmp_path / "sweep_report.md").exists()
    SweepReportCallback().on_multirun_end(hydra_config(tmp_path, job))
    assert (tmp_path / "sweep_report.md").exists()


def test_callback_rejects_non_bool_enabled() -> None:
    with pytest.raises(ValueError, match="sweep_report.enabled must be true or false, got 'yes'"):
        SweepReportCallback(enabled="yes")


def test_target_met_modes() -> None:
    assert target_met(2.0, 2.2, "min") and not target_met(2.3, 2.2, "min")
    assert target_met(0.96, 0.95, "max") and not target_met(0.9, 0.95, "max")
    assert not target_met(float("nan"), 2.2, "min")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"target": float("inf")}, "target must be a finite number"),
    ({"target": "low"}, "target must be a finite number"),
    ({"target": 1.0, "mode": "lowest"}, "mode must be 'min' \\(losses\\) or 'max'"),
])
def test_time_to_target_bad_input(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TimeToTarget(**kwargs)


def test_time_to_target_state_round_trip() -> None:
    timer = TimeToTarget(target=2.0)
    timer.time_to_target_s, timer.target_step, timer._elapsed_before = 4.5, 120, 7.0
    restored = TimeToTarget(target=2.0)
    restored.load_state_dict(timer.state_dict())
    assert restored.final_summary() == timer.final_summary()
    assert restored._elapsed_before == 7.0
    fresh = TimeToTarget(target=2.0)
    fresh.load_state_dict({})  # a checkpoint from before the callback existed
    assert fresh.final_summary()["reached"] is False


def test_time_to_target_from_early_stopping_stop_at(tmp_path: Path) -> None:
    # CurriculumEarlyStopping(stop_at=...) reports target / target_step / target_time_s
    stopping = {"CurriculumEarlyStopping": {"reason": "target", "target": 0.9, "target_step": 40, "target_time_s": 3.25}}
    no_target = {"CurriculumEarlyStopping": {"reason": "patience", "target": None, "target_step": None,
                                             "target_time_s": None}}
    make_job(tmp_path, 0, ["a=1"], summary(1.0, 1, 1.0, 1.0, 1.0, components=stopping))
    make_job(tmp_path, 1, ["a=2"], summary(1.0, 1, 1.0, 1.0, 1.0, components=no_target))
    rows = build_rows([load_job(d) for d in find_job_dirs(tmp_path)])
    assert (rows[0]["time_to_target_s"], rows[0]["target_step"]) == (3.25, 40)
    assert (rows[1]["time_to_target_s"], rows[1]["target_step"]) == (None, None)
