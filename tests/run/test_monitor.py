"""The metric a run follows when neither ``monitor=`` nor the model names one: the user's callback config, else the
metrics the first validation logs, kept through a resume."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from lit_speed.checkpointing import BestAndLastCheckpoint
from lit_speed.models.mlp import MLPClassifier
from lit_speed.run.monitor import choose_monitor, configured_monitor, is_validation_metric, mode_of
from lit_speed.run.runner import train

SHORT = ["trainer.max_epochs=2", "trainer.limit_train_batches=3", "trainer.limit_val_batches=1", "logger=none",
         "callbacks=model_checkpoint", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


class UnnamedMLP(MLPClassifier):
    """A model that names no metric (``monitor = None``), as most users' models do."""

    monitor = None  # type: ignore[assignment]


@pytest.mark.parametrize(("name", "mode"), [("val/loss", "min"), ("val_mse", "min"), ("valid/error_rate", "min"),
                                            ("val/acc", "max"), ("val/f1_macro", "max"), ("val/temperature", None)])
def test_mode_follows_the_metric_name(name, mode):
    assert mode_of(name) == mode


def test_choice_prefers_a_validation_loss_then_a_named_direction():
    assert choose_monitor(["train/loss", "val/acc", "val/loss"]) == ("val/loss", "min")
    assert choose_monitor(["train/loss", "val/acc", "val/temperature"]) == ("val/acc", "max")
    assert choose_monitor(["val/temperature"]) == ("val/temperature", "min")
    assert choose_monitor(["train/loss", "val/loss_step"]) is None  # no validation metric (the _step copy excluded)
    assert is_validation_metric("loss/valid") and not is_validation_metric("interval/steps")


def test_a_literal_monitor_in_the_users_callback_config_is_taken():
    cfg = OmegaConf.create({"callbacks": {"ckpt": {"_target_": "x.Y", "monitor": "val/acc", "mode": "max"}}})
    assert configured_monitor(cfg) == ("val/acc", "max")
    cfg = OmegaConf.create({"monitor": None, "callbacks": {"ckpt": {"_target_": "x.Y", "monitor": "${monitor}"}}})
    assert configured_monitor(cfg) is None  # lit_speed's own ${monitor}: nothing named


def test_follow_monitor_keeps_the_state_key_the_callback_was_built_with(tmp_path):
    callback = BestAndLastCheckpoint(dirpath=tmp_path, monitor=None, mode="max")
    key = callback.state_key
    callback.follow_monitor("val/loss", "min")
    assert (callback.monitor, callback.mode, float(callback.kth_value)) == ("val/loss", "min", float("inf"))
    assert callback.state_key == key  # a resumed run, built with monitor=None again, finds its state
    callback.follow_monitor("val/acc", "max")  # one that follows a metric keeps it
    assert callback.monitor == "val/loss"
    with pytest.raises(ValueError, match=r"mode must be 'min' or 'max'"):
        BestAndLastCheckpoint(dirpath=tmp_path).follow_monitor("val/x", "up")


def test_a_model_that_names_no_metric_follows_its_logged_validation_loss_through_a_resume(make_cfg, tmp_path):
    target = ["model._target_=tests.run.test_monitor.UnnamedMLP"]
    summary = train(make_cfg([*SHORT, *target]))
    assert summary["monitor"] == "val/loss" and summary["best_val"] is not None
    assert "chosen at the first validation" in summary["startup"]["monitor"]
    best = sorted(p.name for p in (tmp_path / "checkpoints").glob("best-*.ckpt"))
    assert len(best) == 1
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["callbacks"]
    assert saved["RunPlanCheck"] == {"chosen": ["val/loss", "min"]}
    state = next(v for k, v in saved.items() if k.startswith("BestAndLastCheckpoint"))
    assert state["monitor"] == "val/loss" and state["best_model_score"] is not None
    resumed = train(make_cfg([*SHORT, *target, "trainer.max_epochs=3", "trainer.num_sanity_val_steps=0",
                              "validate=false", f"ckpt_path={tmp_path / 'checkpoints' / 'last.ckpt'}"]))
    assert resumed["monitor"] == "val/loss" and resumed["global_step"] == 9
    assert resumed["best_val"] <= summary["best_val"]  # the best carried over, then possibly improved
