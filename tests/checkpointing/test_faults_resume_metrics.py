"""``metrics.csv`` after a resume equals the uninterrupted run's (issue 33, E), not only the weights.

Three holes, each found with the weights bitwise equal or nearly so:

1. A checkpoint written at an epoch's end without validation there (``ModelCheckpoint`` in ``on_train_epoch_end``;
   ``callbacks=[default,validation_budget]`` does this once the cadence outgrows the epoch) with ``max_steps`` set:
   Lightning 2.6.6 restarted inside the finished epoch and trained one batch more, shifting every later row (and
   the weights, by then) by one step; and the epoch's ``train/acc`` row, written after the checkpoint, was lost.
2. A mid-epoch resume logged the interrupted epoch's ``train/acc`` over the resumed batches only: the metric's
   accumulated state (``torchmetrics``, every process's own under DDP) was in no checkpoint.
3. A checkpoint written in ``on_train_batch_end`` (``every_n_train_steps``) comes before that batch's log row, which
   the resumed run never writes.
4. A stop (SIGTERM) after a batch that validated: the resumed run counted that batch again for the loggers, so every
   later row was one step late (found by ``benchmarks/signal_trials.py``: 3 of 24 random stops, all at such a batch).
"""
from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lit_speed.checkpointing import FaultTolerance, ResumableCSVLogger  # noqa: E402
from lit_speed.checkpointing.stop_signals import INBOX
from lit_speed.data.digits import DigitsDataModule  # noqa: E402
from lit_speed.models.mlp import MLPClassifier  # noqa: E402
from tests.helpers.fault_scripts.compare_checkpoints import assert_bitwise_equal, assert_same_rows, metrics_rows
from tests.helpers.fault_scripts.kill_at_step import NoteSignalAt
from tests.helpers.fault_scripts.runs import SHORT_RUN, explain, kill_at, train, train_side_by_side


class _CrashAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: "pl.Trainer", *args: object) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("crash")


def _fit(root: Path, checkpoint: ModelCheckpoint, crash_at: int | None = None, resume: bool = False,
         **trainer_kwargs: object) -> None:
    pl.seed_everything(3, workers=True)
    model = MLPClassifier(hidden=32, depth=1, dropout=0.1, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    callbacks = [FaultTolerance(), checkpoint] + ([_CrashAt(crash_at)] if crash_at is not None else [])
    trainer = pl.Trainer(accelerator="cpu", limit_train_batches=8, limit_val_batches=0, log_every_n_steps=2,
                         logger=ResumableCSVLogger(root, name="csv", version=""), enable_progress_bar=False,
                         enable_model_summary=False, deterministic=True, default_root_dir=root, callbacks=callbacks,
                         **trainer_kwargs)
    trainer.fit(model, datamodule=DigitsDataModule(batch_size=32), ckpt_path=str(root / "ckpt" / "last.ckpt") if resume else None)


def _run_and_resume(tmp_path: Path, make_checkpoint, crash_at: int, **trainer_kwargs: object) -> None:
    _fit(tmp_path / "reference", make_checkpoint(tmp_path / "reference"), **trainer_kwargs)
    with pytest.raises(RuntimeError, match="crash"):
        _fit(tmp_path / "run", make_checkpoint(tmp_path / "run"), crash_at=crash_at, **trainer_kwargs)
    _fit(tmp_path / "run", make_checkpoint(tmp_path / "run"), resume=True, **trainer_kwargs)
    reference, run = (metrics_rows(p / "csv" / "metrics.csv") for p in (tmp_path / "reference", tmp_path / "run"))
    assert_same_rows(run, reference)
    assert_bitwise_equal(tmp_path / "reference" / "ckpt" / "last.ckpt", tmp_path / "run" / "ckpt" / "last.ckpt")


def test_a_resume_from_a_mid_epoch_batch_end_checkpoint_writes_the_same_metrics_csv(tmp_path):
    # checkpoint at step 6 (on_train_batch_end, mid-epoch 1 of 8 batches), crash at 7: the epoch's train/acc must
    # count all 8 batches, and step 6's row (logged after the checkpoint) must be there
    def checkpoint(root: Path) -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=root / "ckpt", save_last=True, every_n_train_steps=3, save_top_k=0)

    _run_and_resume(tmp_path, checkpoint, crash_at=7, max_epochs=2)


def test_a_resume_from_an_epoch_end_checkpoint_with_max_steps_neither_retrains_a_batch_nor_loses_the_epoch_row(tmp_path):
    # no validation: ModelCheckpoint saves in on_train_epoch_end (step 8), crash at 10; max_steps makes Lightning
    # count it as iteration-based training, where the restart went back into the finished epoch
    def checkpoint(root: Path) -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=root / "ckpt", save_last=True, every_n_epochs=1, save_on_train_epoch_end=True)

    _run_and_resume(tmp_path, checkpoint, crash_at=10, max_steps=20, max_epochs=-1)


def test_a_stop_after_a_batch_that_validated_resumes_logging_at_the_same_steps(tmp_path):
    # 8 batches per epoch, validation every 4: SIGTERM at step 4 (that batch validated, then the stop saved)
    INBOX.clear()

    def fit(root: Path, *extra: Callback, resume: bool = False) -> None:
        pl.seed_everything(3, workers=True)
        model = MLPClassifier(hidden=32, depth=1, dropout=0.1, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
        trainer = pl.Trainer(accelerator="cpu", max_epochs=2, limit_train_batches=8, limit_val_batches=2,
                             val_check_interval=4, log_every_n_steps=1, deterministic=True,
                             logger=ResumableCSVLogger(root, name="csv", version=""), enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=root,
                             callbacks=[FaultTolerance(), ModelCheckpoint(dirpath=root / "ckpt", save_last=True),
                                        *extra])
        trainer.fit(model, datamodule=DigitsDataModule(batch_size=32),
                    ckpt_path=str(root / "ckpt" / "last.ckpt") if resume else None)

    fit(tmp_path / "reference")
    with pytest.raises(SystemExit):
        fit(tmp_path / "run", NoteSignalAt(4))
    fit(tmp_path / "run", resume=True)
    reference, run = (metrics_rows(p / "csv" / "metrics.csv") for p in (tmp_path / "reference", tmp_path / "run"))
    assert_same_rows(run, reference)


# ---------------------------------------------------------------------------------------------- through train.py
def _assert_same_run(reference: Path, run: Path) -> None:
    ref_rows, run_rows = metrics_rows(reference / "csv" / "metrics.csv"), metrics_rows(run / "csv" / "metrics.csv")
    assert_same_rows(run_rows, ref_rows)
    assert_bitwise_equal(reference / "checkpoints" / "last.ckpt", run / "checkpoints" / "last.ckpt")


@pytest.mark.slow
def test_validation_budget_run_resumed_after_an_epoch_end_checkpoint_logs_like_the_uninterrupted_run(tmp_path):
    # the case: digits with callbacks=[default,validation_budget] and max_steps; the budget's interval (>= 25
    # batches) outgrows the 23-batch epoch, so checkpoints land in on_train_epoch_end. Killed after the epoch-2 one.
    args = ["callbacks=[default,validation_budget]", "trainer.max_steps=80", "trainer.max_epochs=-1",
            "trainer.deterministic=true", "trainer.enable_progress_bar=false", "validate=false", "seed=7"]
    reference, killed = train_side_by_side((args, tmp_path / "reference"), (args + kill_at(52), tmp_path / "run"))
    assert reference.returncode == 0, explain(reference)
    assert killed.returncode == -9, explain(killed)
    resumed = train(args + ["ckpt_path=last"], tmp_path / "run")
    assert resumed.returncode == 0, explain(resumed)
    _assert_same_run(tmp_path / "reference", tmp_path / "run")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_two_processes_resumed_mid_epoch_log_the_epochs_train_acc_like_the_uninterrupted_run(tmp_path, strategy):
    # last.ckpt at step 4, half-way through the first epoch; each process's share of train/acc comes back
    args = [a for a in SHORT_RUN if a != "logger=none"] + [
        "trainer=ddp_cpu", f"strategy={strategy}", "callbacks.model_checkpoint.every_n_train_steps=2",
        "trainer.log_every_n_steps=1"]
    reference, killed = train_side_by_side((args, tmp_path / "reference"), (args + kill_at(5), tmp_path / "run"))
    assert reference.returncode == 0, explain(reference)
    assert killed.returncode != 0, explain(killed)
    resumed = train(args + ["ckpt_path=last"], tmp_path / "run")
    assert resumed.returncode == 0, explain(resumed)
    _assert_same_run(tmp_path / "reference", tmp_path / "run")
