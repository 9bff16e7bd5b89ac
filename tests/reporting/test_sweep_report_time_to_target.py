"""TimeToTarget through a real Trainer on digits: records the first validation that meets the target, and stops."""
from __future__ import annotations

import functools

import lightning.pytorch as pl
import torch

from lit_speed.data.digits import DigitsDataModule
from lit_speed.models.mlp import MLPClassifier
from lit_speed.reporting import TimeToTarget


class RecordVal(pl.Callback):
    """The val/acc of every (non-sanity) validation, with the step it ran at."""

    def __init__(self) -> None:
        self.history: list[tuple[int, float]] = []

    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not trainer.sanity_checking:
            self.history.append((trainer.global_step, float(trainer.callback_metrics["val/acc"])))


def fit(tmp_path, target: float, stop: bool) -> tuple[TimeToTarget, RecordVal, pl.Trainer]:
    pl.seed_everything(0)
    model = MLPClassifier(hidden=64, depth=1, optimizer=functools.partial(torch.optim.AdamW, lr=3e-3))
    timer, record = TimeToTarget(target=target, monitor="val/acc", mode="max", stop=stop), RecordVal()
    trainer = pl.Trainer(accelerator="cpu", max_steps=60, val_check_interval=5, limit_val_batches=2,
                         callbacks=[timer, record], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, datamodule=DigitsDataModule(batch_size=32))
    return timer, record, trainer


def test_records_first_validation_meeting_target_and_stops(tmp_path) -> None:
    # 0.5 accuracy is reached within 60 steps of this MLP, but not at its first validation (step 5)
    timer, record, trainer = fit(tmp_path, target=0.5, stop=True)
    first = next(step for step, acc in record.history if acc >= 0.5)
    assert record.history[0][1] < 0.5
    summary = timer.final_summary()
    assert summary["reached"] and summary["target_step"] == first
    assert trainer.global_step == first  # stopped at that validation
    assert 0.0 < summary["time_to_target_s"] and 0.0 < summary["cpu_time_to_target_s"]


def test_unreachable_target_is_reported_not_reached(tmp_path) -> None:
    timer, _, trainer = fit(tmp_path, target=1.01, stop=True)  # accuracy can never exceed 1
    assert trainer.global_step == 60
    assert timer.final_summary() == {"target": 1.01, "monitor": "val/acc", "mode": "max", "reached": False,
                                     "time_to_target_s": None, "cpu_time_to_target_s": None, "target_step": None}
