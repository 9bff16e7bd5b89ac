"""Progress that fits slow steps (issue 50, item 4): steps done of ``max_steps`` when steps end the run, the pace in
seconds per step once a step takes longer than a second, the run's time left; rates in the summary with significant
digits.

Before: a 1B run of ``max_steps=2`` showed ``Epoch 0/19 2/397 0:03:46 • -:--:-- 0.00it/s`` (Lightning's bar counts
the epoch's batches against ``max_epochs`` and takes its rate from rich's samples of the last 30 s: none at 80 s per
step) and ended with ``throughput 0 samples/s``. The steps here are fast; a fake clock makes each one 80 s long.
"""
from __future__ import annotations

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from lit_speed.monitoring import step_progress_bar as spb
from lit_speed.monitoring.step_progress_bar import StepProgressBar, clock, pace_text, time_left_s
from lit_speed.run.summary import significant
from lit_speed.tables import format_rate
from tests.monitoring.test_device_stats_logger import Regression

STEP_S = 80.0


class Watch(Callback):
    """After the bar's batch end: what the train bar holds."""

    def __init__(self, bar: StepProgressBar) -> None:
        self.bar, self.seen = bar, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        task = self.bar.train_progress_bar
        self.seen.append((task.description, task.completed, task.total, dict(task.fields)))


@pytest.fixture
def slow_clock(monkeypatch):
    """Each reading of the bar's clock is one 80 s step later than the one before."""
    ticks = iter(range(10_000))
    monkeypatch.setattr(spb, "time", SimpleNamespace(monotonic=lambda: STEP_S * next(ticks)))


def _fit(tmp_path, bar: StepProgressBar, **trainer_kwargs) -> Watch:
    watch = Watch(bar)
    data = DataLoader(TensorDataset(torch.randn(40, 4), torch.randn(40, 4)), batch_size=4)  # 10 batches per epoch
    trainer = pl.Trainer(callbacks=[bar, watch], logger=False, enable_checkpointing=False, enable_model_summary=False,
                         default_root_dir=tmp_path, accelerator="cpu", **trainer_kwargs)
    trainer.fit(Regression(4, 1), data)
    return watch


def test_when_max_steps_ends_the_run_the_bar_counts_steps_of_max_steps_with_s_per_step_and_time_left(
        tmp_path, slow_clock):
    bar = StepProgressBar()
    watch = _fit(tmp_path, bar, max_steps=4, max_epochs=20)
    assert bar.by_steps
    assert [(d, c, t) for d, c, t, _ in watch.seen] == [("Epoch 0", n, 4) for n in (1, 2, 3, 4)]  # not "Epoch 0/19"
    assert [f["pace"] for *_, f in watch.seen] == ["80.0 s/step"] * 4
    assert [f["left_s"] for *_, f in watch.seen] == [3 * STEP_S, 2 * STEP_S, STEP_S, 0.0]
    task = bar.train_progress_bar
    assert spb._CountColumn(style="").render(task).plain == "4/4 steps"
    assert spb._PaceColumn(style="").render(task).plain == "80.0 s/step"
    assert spb._TimeLeftColumn(style="").render(task).plain.endswith("• 0:00:00 left")


def test_one_bar_runs_across_epochs_when_steps_end_the_run(tmp_path, slow_clock):
    bar = StepProgressBar()
    watch = _fit(tmp_path, bar, max_steps=13, max_epochs=5)  # 10 batches per epoch: epoch 1 holds steps 11-13
    assert [(d, c, t) for d, c, t, _ in watch.seen[9:12]] == [("Epoch 0", 10, 13), ("Epoch 1", 11, 13),
                                                             ("Epoch 1", 12, 13)]


def test_when_epochs_end_the_run_batches_are_counted_and_the_time_left_covers_the_later_epochs(tmp_path, slow_clock):
    bar = StepProgressBar()
    watch = _fit(tmp_path, bar, max_epochs=2)
    assert not bar.by_steps
    description, completed, total, fields = watch.seen[4]  # epoch 0, batch 5 of 10
    assert (completed, total, fields["pace"]) == (5, 10, "80.0 s/batch")
    assert fields["left_s"] == (5 + 10) * STEP_S  # this epoch's 5 batches and the next epoch's 10


def test_pace_and_time_left_texts():
    assert pace_text(81.34, "step") == "81.3 s/step" and pace_text(312.0, "step") == "312 s/step"
    assert pace_text(0.25, "step") == "4.00 steps/s" and pace_text(None, "step") == "-- s/step"
    assert time_left_s(2, 200, 80.0) == 198 * 80.0 and time_left_s(2, None, 80.0) is None
    assert clock(3723.9) == "1:02:03" and clock(None) == "-:--:--"


def test_the_runner_puts_the_step_bar_in_and_keeps_it_out_when_the_bar_is_off(make_cfg):
    from lit_speed.run.runner import build

    trainer = build(make_cfg(["trainer.max_steps=3", "logger=none"]))["trainer"]
    assert isinstance(trainer.progress_bar_callback, StepProgressBar)
    assert build(make_cfg(["trainer.enable_progress_bar=false", "logger=none"]))["trainer"].progress_bar_callback is None


def test_rates_keep_their_significant_digits():
    assert format_rate(0.0523, "samples/s") == "0.0523 samples/s"  # was "0 samples/s"
    assert format_rate(19.74, "tokens/s") == "19.7 tokens/s" and format_rate(12345.6, "tokens/s") == "12,346 tokens/s"
    assert significant(0.0043219) == 0.004322 and significant(1234567.0) == 1235000.0


def test_the_end_of_run_table_shows_a_slow_run_s_rate(tmp_path, capsys):
    from omegaconf import OmegaConf

    from lit_speed.run.runner import write_summary

    summary = {"fit_wall_time_s": 374.0, "train_time_s": 160.0, "launch_to_end_s": 380.0, "time_split_s": {},
               "samples_per_sec": 0.05, "tokens_per_sec": 25.6, "peak_rss_bytes": 2**30, "global_step": 2,
               "monitor": "val/loss", "best_val": None}
    nothing = SimpleNamespace(precision_plugin=None, strategy=None, callbacks=[])
    write_summary(OmegaConf.create({"paths": {"output_dir": str(tmp_path)}}), nothing, summary)
    assert "0.05 samples/s, 25.6 tokens/s" in capsys.readouterr().out
