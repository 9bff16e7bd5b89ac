"""ValidateEveryNSteps: validation every N optimizer steps whatever the accumulation, alone in a plain Trainer."""
from __future__ import annotations

import functools
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lit_speed import AccumulationScheduler, ValidationBudget
from lit_speed.data.digits import DigitsDataModule
from lit_speed.models.mlp import MLPClassifier
from lit_speed.monitoring.validate_every_n_steps import ValidateEveryNSteps, validation_due


def test_validation_is_due_when_a_batch_steps_onto_a_multiple():
    assert validation_due(2, 3, 3) and validation_due(5, 6, 3)
    assert not validation_due(3, 3, 3)  # a batch inside an accumulation window: no step, no validation
    assert not validation_due(3, 4, 3) and not validation_due(0, 1, 3)


def test_a_bad_interval_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"ValidateEveryNSteps\(every_n_steps=0\): must be an int >= 1\. Fix: "):
        ValidateEveryNSteps(0)


class Steps(Callback):
    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_validation_start(self, trainer: "pl.Trainer", pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self.seen.append(trainer.global_step)


def _fit(tmp_path, max_steps: int, callbacks: list[Callback], ckpt_path: str | None = None,
         **trainer_kwargs: Any) -> Steps:
    steps = Steps()
    trainer = pl.Trainer(accelerator="cpu", max_steps=max_steps, limit_val_batches=1, num_sanity_val_steps=0,
                         logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[*callbacks, steps], **trainer_kwargs)
    model = MLPClassifier(optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    trainer.fit(model, DigitsDataModule(batch_size=32), ckpt_path=ckpt_path)
    return steps


def test_it_validates_every_n_optimizer_steps_under_a_changing_accumulation(tmp_path):
    # factors 1, 3, then 5 micro-batches per step: every 4 steps whatever the window (45 batches/epoch: 2 epochs)
    accumulation = AccumulationScheduler(factors={0: 1, 4: 3, 8: 5})
    steps = _fit(tmp_path, 20, [accumulation, ValidateEveryNSteps(4)])
    assert steps.seen == [4, 8, 12, 16, 20]


def test_a_resumed_run_validates_at_the_same_steps(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_last=True)
    _fit(tmp_path, 5, [AccumulationScheduler(factors={0: 2}), ValidateEveryNSteps(3), checkpoint])
    resumed = _fit(tmp_path, 12, [AccumulationScheduler(factors={0: 2}), ValidateEveryNSteps(3)],
                   ckpt_path=str(tmp_path / "last.ckpt"))
    assert resumed.seen == [6, 9, 12]


@pytest.mark.parametrize(("kwargs", "extra", "message"), [
    ({"val_check_interval": 5}, [], r"Trainer\(val_check_interval=5\) would be ignored: every_n_steps=3 decides"),
    ({"check_val_every_n_epoch": 2}, [], r"Trainer\(check_val_every_n_epoch=2\) would skip the steps"),
    ({}, [ValidationBudget()], r"ValidationBudget sets the validation cadence too"),
])
def test_a_cadence_it_would_override_is_refused_at_setup(tmp_path, kwargs, extra, message):
    with pytest.raises(ValueError, match=rf"^ValidateEveryNSteps: {message}.*Fix: "):
        _fit(tmp_path, 2, [ValidateEveryNSteps(3), *extra], **kwargs)
