"""``last.ckpt`` is the newest state (not the last improvement), and a resumed run keeps its metrics rows."""
from __future__ import annotations

import csv
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_speed.checkpointing import BestAndLastCheckpoint, FaultTolerance, ResumableCSVLogger

STEPS_PER_EPOCH = 4


class Worsening(pl.LightningModule):
    """A regression whose logged ``val/score`` gets worse every epoch: the best checkpoint stays at epoch 1."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/score", float(self.current_epoch))  # lower is better: only epoch 0 is ever the best

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)), batch_size=4)


def _fit(folder: Path, ckpt_path: str | None = None, **kwargs) -> tuple[pl.Trainer, BestAndLastCheckpoint]:
    checkpoint = BestAndLastCheckpoint(dirpath=folder / "checkpoints", monitor="val/score", mode="min",
                                       save_top_k=1, save_last=True)
    settings = dict(max_epochs=3, log_every_n_steps=1, num_sanity_val_steps=0, enable_progress_bar=False,
                    enable_model_summary=False, deterministic=True)
    settings.update(kwargs)
    trainer = pl.Trainer(accelerator="cpu", logger=ResumableCSVLogger(folder, name="csv", version=""),
                         callbacks=[checkpoint, FaultTolerance()], **settings)
    trainer.fit(Worsening(), train_dataloaders=_loader(), val_dataloaders=_loader(), ckpt_path=ckpt_path)
    return trainer, checkpoint


def _step(path: Path) -> int:
    return torch.load(path, weights_only=True)["global_step"]


def test_last_checkpoint_is_the_final_state_although_the_metric_got_worse(tmp_path: Path) -> None:
    trainer, checkpoint = _fit(tmp_path)
    folder = tmp_path / "checkpoints"
    assert _step(folder / "last.ckpt") == trainer.global_step == 3 * STEPS_PER_EPOCH
    assert [p.name for p in folder.glob("epoch*.ckpt")] and _step(next(folder.glob("epoch*.ckpt"))) == STEPS_PER_EPOCH
    # Lightning's own ModelCheckpoint keeps last.ckpt at the last improvement (the test can fail)
    plain = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "plain", monitor="val/score", mode="min", save_last=True)
    pl.Trainer(accelerator="cpu", max_epochs=3, logger=False, callbacks=[plain], num_sanity_val_steps=0,
               enable_progress_bar=False).fit(Worsening(), _loader(), _loader())
    assert _step(tmp_path / "plain" / "last.ckpt") == STEPS_PER_EPOCH


def test_last_checkpoint_at_the_end_of_a_run_stopped_by_max_steps_mid_epoch(tmp_path: Path) -> None:
    trainer, _ = _fit(tmp_path, max_epochs=-1, max_steps=6)  # epoch ends at 4, 8: no validation at step 6
    assert _step(tmp_path / "checkpoints" / "last.ckpt") == trainer.global_step == 6


def _rows(folder: Path) -> list[dict[str, str]]:
    with (folder / "csv" / "metrics.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def test_a_resumed_run_keeps_the_rows_before_its_checkpoint_and_reads_as_the_uninterrupted_run(tmp_path: Path) -> None:
    _fit(tmp_path / "reference", max_epochs=3)
    # the "killed" run got to step 10 (its rows for steps 8 and 9 are on disk), its last checkpoint is step 8
    _fit(tmp_path / "run", max_epochs=-1, max_steps=10)
    step8 = tmp_path / "run" / "checkpoints" / "last.ckpt.prev"  # the version the final save (step 10) replaced
    assert _step(step8) == 2 * STEPS_PER_EPOCH
    _fit(tmp_path / "run", ckpt_path=str(step8), max_epochs=3)
    resumed, reference = _rows(tmp_path / "run"), _rows(tmp_path / "reference")
    assert [(r["step"], r.get("train/loss"), r.get("val/score")) for r in resumed] == \
        [(r["step"], r.get("train/loss"), r.get("val/score")) for r in reference]
    assert not (tmp_path / "run" / "csv" / "metrics.csv.before-resume").exists()  # restored, then removed
