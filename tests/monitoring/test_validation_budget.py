"""ValidationBudget: the validation cadence follows the measured costs; the rule, the wiring and the resume."""
from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lit_speed import ValidationBudget
from lit_speed.monitoring.validation_budget import interval_for_budget


def test_the_interval_keeps_validation_within_the_budget():
    # 1 s of validation, 10 ms batches, 5%: 1 / (1 + n * 0.01) <= 0.05  <=>  n >= 1900
    assert interval_for_budget(1.0, 0.01, 0.05) == 1900
    n = interval_for_budget(0.37, 0.023, 0.1)
    assert 0.37 / (0.37 + n * 0.023) <= 0.1 < 0.37 / (0.37 + (n - 1) * 0.023)
    assert interval_for_budget(1.0, 0.01, 0.05, maximum=500) == 500
    assert interval_for_budget(0.0, 0.01, 0.05, minimum=25) == 25


@pytest.mark.parametrize("kwargs, match", [({"max_fraction": 1.5}, r"max_fraction must be in \(0, 1\), got 1\.5"),
                                           ({"min_interval": 0}, r"needs 1 <= min_interval <= max_interval"),
                                           ({"min_interval": 9, "max_interval": 3}, r"min_interval=9, max_interval=3")])
def test_bad_settings_are_refused_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ValidationBudget(**kwargs)


class Clock:
    """Stands in for ``time`` in the callback: the model's steps advance it by fixed, binary-exact amounts, so the
    measured costs are exact on any machine, however busy (real sleeps moved the interval by +-50% under load)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


class SlowValidation(pl.LightningModule):
    """Training batches of 1/128 s, a validation pass of 4 x 1/64 s on the callback's clock: the budget, not the
    model, sets the cadence."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.validations = 0
        self.clock = clock

    def training_step(self, batch, batch_idx):
        self.clock.now += 1 / 128
        return self.net(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.clock.now += 1 / 64
        self.log("val_loss", self.net(batch[0]).pow(2).mean())

    def on_validation_end(self) -> None:
        self.validations += 1

    def _loader(self, n):
        return DataLoader(TensorDataset(torch.randn(n, 4)), batch_size=1)

    def train_dataloader(self):
        return self._loader(400)

    def val_dataloader(self):
        return self._loader(4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(root, budget, max_steps, ckpt_path=None, clock=None):
    model = SlowValidation(clock or Clock())
    trainer = pl.Trainer(max_steps=max_steps, val_check_interval=10, check_val_every_n_epoch=None,
                         num_sanity_val_steps=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=root, callbacks=[budget, ModelCheckpoint(dirpath=root, save_last=True)])
    trainer.fit(model, ckpt_path=ckpt_path)
    return model, trainer


def test_the_first_validation_sets_the_cadence_and_a_resume_keeps_it(tmp_path, monkeypatch):
    clock = Clock()
    monkeypatch.setattr("lit_speed.monitoring.validation_budget.time", clock)
    budget = ValidationBudget(max_fraction=0.25, max_interval=200)
    model, trainer = _fit(tmp_path, budget, 120, clock=clock)
    # 1/16 s of validation, 1/128 s batches, 25%: (1/16) / (1/16 + n/128) <= 1/4  <=>  n >= 24
    assert budget.interval == 24 and trainer.val_check_batch == 24
    assert "one validation 0.06 s, one training batch 7.8 ms" in budget.reason
    assert model.validations == 1 + sum(1 for b in range(10, 120) if (b + 1) % 24 == 0) == 6

    resumed = ValidationBudget(max_fraction=0.25, max_interval=200)
    _, trainer = _fit(tmp_path, resumed, 130, ckpt_path=str(tmp_path / "last.ckpt"), clock=clock)
    assert resumed.interval == budget.interval and trainer.val_check_batch == budget.interval
    assert resumed.reason.startswith("restored from the checkpoint")
