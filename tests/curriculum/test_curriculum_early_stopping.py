"""CurriculumEarlyStopping: patience units, waiting for the curriculum, stop_at, non-finite, time budget."""
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import TensorDataset

from lit_speed.curriculum import CurriculumDataModule, CurriculumEarlyStopping

N, BS = 40, 4  # 10 batches per epoch


class ScriptedMetric(pl.LightningModule):
    """Trains a tiny layer; validation logs ``val/metric`` from a script, one value per validation check."""

    def __init__(self, values):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.values = list(values)
        self.checks = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x).squeeze(-1), y)

    def validation_step(self, batch, batch_idx):
        self.log("val/metric", float(self.values[min(self.checks, len(self.values) - 1)]))

    def on_validation_epoch_end(self):
        self.checks += 1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _data(n):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 2, generator=g), torch.randn(n, generator=g))


def _fit(tmp_path, stopper, values, max_steps=60, **dm_kwargs):
    dm_kwargs.setdefault("pacing", "none")
    dm = CurriculumDataModule(train_dataset=_data(N), val_dataset=_data(8), batch_size=BS, **dm_kwargs)
    model = ScriptedMetric(values)
    trainer = pl.Trainer(max_steps=max_steps, val_check_interval=2, check_val_every_n_epoch=None, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         num_sanity_val_steps=0, callbacks=[stopper], default_root_dir=tmp_path)
    trainer.fit(model, datamodule=dm)
    return trainer, dm


def test_patience_never_fires_while_the_curriculum_widens(tmp_path):
    stopper = CurriculumEarlyStopping("val/metric", mode="min", patience=1)
    trainer, dm = _fit(tmp_path, stopper, [1.0], pacing="linear", start_fraction=0.25, pace_duration=20)
    # the metric never improves after the first check; widening ends at batch 20, the check at step 22 stops it
    assert stopper.reason == "patience"
    assert trainer.global_step == 22
    assert dm.fraction_at(20) == 1.0 and dm.fraction_at(19) < 1.0
    assert trainer.callback_metrics["curriculum/allowed_fraction"] == 1.0  # logged every step by the callback


def test_without_waiting_patience_fires_during_widening(tmp_path):
    stopper = CurriculumEarlyStopping("val/metric", mode="min", patience=1, wait_for_curriculum=False)
    trainer, _ = _fit(tmp_path, stopper, [1.0], pacing="linear", start_fraction=0.25, pace_duration=20)
    assert stopper.reason == "patience" and trainer.global_step == 4  # the control: the guard above is what held it


def test_stop_at_stops_on_the_first_check_meeting_the_target(tmp_path):
    stopper = CurriculumEarlyStopping("val/metric", mode="max", patience=None, stop_at=0.9)
    trainer, _ = _fit(tmp_path, stopper, [0.5, 0.7, 0.89, 0.91, 0.95])
    summary = stopper.final_summary()
    assert summary["reason"] == "target" and summary["target_step"] == 8 == trainer.global_step  # 4th check
    # the check that met the target is the best: 0.91 at step 8 (it reported a stale 0.89 at step 6 before)
    assert summary["target_time_s"] > 0 and summary["best"] == pytest.approx(0.91) and summary["best_step"] == 8


def test_stop_is_written_to_the_loggers(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(tmp_path, name="es")
    stopper = CurriculumEarlyStopping("val/metric", mode="max", patience=None, stop_at=0.9)
    dm = CurriculumDataModule(train_dataset=_data(N), val_dataset=_data(8), batch_size=BS, pacing="none")
    trainer = pl.Trainer(max_steps=20, val_check_interval=2, check_val_every_n_epoch=None, logger=logger,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         num_sanity_val_steps=0, callbacks=[stopper], default_root_dir=tmp_path)
    trainer.fit(ScriptedMetric([0.5, 0.95]), datamodule=dm)
    logger.save()
    text = (Path(logger.log_dir) / "metrics.csv").read_text()
    assert "early_stopping/target_time_s" in text and "early_stopping/stopped_step" in text


def test_nan_metric_stops_with_that_reason(tmp_path):
    stopper = CurriculumEarlyStopping("val/metric", mode="min", patience=100)
    trainer, _ = _fit(tmp_path, stopper, [1.0, 0.5, math.nan], pacing="linear", start_fraction=0.5, pace_duration=40)
    assert stopper.reason == "non_finite" and trainer.global_step == 6
    assert "is not finite" in stopper.final_summary()["message"]


def test_time_budget_stops_training(tmp_path):
    stopper = CurriculumEarlyStopping("val/metric", patience=None, time_budget_s=0.0)
    trainer, _ = _fit(tmp_path, stopper, [1.0])
    assert stopper.reason == "time_budget" and trainer.global_step == 1


@pytest.mark.parametrize("unit, patience, stop_check", [("checks", 3, 4), ("steps", 5, 4), ("seconds", 10.0, 5)])
def test_patience_units(unit, patience, stop_check):
    stopper = CurriculumEarlyStopping("m", mode="min", patience=patience, patience_unit=unit, min_delta=0.01)
    results = []
    for k in range(1, 8):  # one check every 2 steps and 3 seconds; only the first value is an improvement
        value = 1.0 if k == 1 else 0.995  # better, but not by more than min_delta
        results.append(stopper.check(value, step=2 * k, seconds=3.0 * k, widening=False)[0])
    assert results.index("patience") + 1 == stop_check
    assert stopper.best == 1.0


def test_best_includes_the_check_that_met_the_target():
    # issue 16 item 5: stop_at=2.45 met by 2.4399 at step 125 used to report best 2.527 at step 87
    stopper = CurriculumEarlyStopping("val_loss", mode="min", patience=None, stop_at=2.45, min_delta=0.1)
    assert stopper.check(2.527, step=87, seconds=1.0, widening=False) == (None, None)
    assert stopper.check(2.4399, step=125, seconds=2.0, widening=False)[0] == "target"
    summary = stopper.final_summary()
    assert summary["best"] == pytest.approx(2.4399) and summary["best_step"] == 125 == summary["target_step"]


def test_divergence_and_state_roundtrip():
    stopper = CurriculumEarlyStopping("m", mode="min", divergence_threshold=5.0)
    assert stopper.check(2.0, 1, 1.0, False) == (None, None)
    state = stopper.state_dict()
    fresh = CurriculumEarlyStopping("m", mode="min", divergence_threshold=5.0)
    fresh.load_state_dict(state)
    assert fresh.best == 2.0 and fresh.checks == 1 and fresh.anchor == stopper.anchor
    assert fresh.check(6.0, 2, 2.0, False)[0] == "divergence"
    fresh.load_state_dict({})  # keys added later are read with defaults
    assert fresh.checks == 0


def test_missing_monitor_is_an_error_naming_the_setting(tmp_path):
    with pytest.raises(RuntimeError, match="early stopping monitors 'val/nope', which was not logged"):
        _fit(tmp_path, CurriculumEarlyStopping("val/nope"), [1.0])


def test_construction_errors_teach():
    with pytest.raises(ValueError, match=r"CurriculumEarlyStopping\(mode='up'\): mode must be one of "
                                         r"\('min', 'max'\), got 'up'"):
        CurriculumEarlyStopping("m", mode="up")
    with pytest.raises(ValueError, match=r"patience_unit must be one of .*got 'epochs'"):
        CurriculumEarlyStopping("m", patience_unit="epochs")
    with pytest.raises(ValueError, match=r"CurriculumEarlyStopping\(patience=-1\): patience must be >= 0"):
        CurriculumEarlyStopping("m", patience=-1)
