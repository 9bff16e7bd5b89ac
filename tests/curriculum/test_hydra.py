"""The Hydra options compose into a run: data=digits_curriculum + callbacks=[curriculum_early_stopping], through train()."""
import json

from lit_speed.run.runner import train


def test_digits_curriculum_with_early_stopping_runs_and_reports_its_stop(make_cfg, tmp_path):
    cfg = make_cfg(["data=digits_curriculum", "callbacks=[curriculum_early_stopping]", "callbacks.curriculum_early_stopping.stop_at=0.5",
                    "callbacks.curriculum_early_stopping.patience=null", "data.pace_duration=20", "trainer.max_epochs=3",
                    "+trainer.val_check_interval=5", "logger=none", "validate=false"])
    summary = train(cfg)
    stop = summary["components"]["CurriculumEarlyStopping"]
    assert stop["reason"] == "target" and stop["target_step"] == summary["global_step"]
    assert stop["target_time_s"] > 0 and stop["message"].startswith("val/acc = ")
    assert "curriculum" in summary["startup"] and "centroid" in summary["startup"]["curriculum"]
    assert "early stopping" in summary["startup"]
    assert json.loads((tmp_path / "summary.json").read_text())["components"]["CurriculumEarlyStopping"] == stop
