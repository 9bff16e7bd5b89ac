"""RunSummary's time split: ``data`` is the DataModule's set-up, and the other callbacks' ``setup`` work (a regional
compile, a timed choice) counts as ``fit_setup`` (found on an H200: compiled rows read 3.8-4.1 s of "data" against
0.45 s for the same rows eager)."""
from __future__ import annotations

import time

import lightning.pytorch as pl
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

from lit_speed.run import summary as summary_module
from lit_speed.run.summary import DataReady, RunSummary

STEP = 100.0  # a fake clock's jump: what each slow set-up "takes", far above the real seconds of this tiny fit


def _clock(monkeypatch):
    offset = [0.0]
    real = time.perf_counter
    monkeypatch.setattr(summary_module.time, "perf_counter", lambda: real() + offset[0])
    return offset


class SlowData(BoringDataModule):
    def __init__(self, offset):
        super().__init__()
        self.offset = offset

    def setup(self, stage):
        super().setup(stage)
        self.offset[0] += STEP / 10  # the data's own set-up


class SlowSetup(pl.Callback):  # stands in for a callback that compiles or times something in setup
    def __init__(self, offset):
        self.offset = offset

    def setup(self, trainer, pl_module, stage):
        self.offset[0] += STEP


def _fit(callbacks, offset, summary):
    trainer = pl.Trainer(max_steps=2, callbacks=callbacks, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0)
    summary.fit_called_at = summary_module.time.perf_counter()
    trainer.fit(BoringModel(), datamodule=SlowData(offset))
    return trainer


def test_callbacks_setup_counts_as_fit_setup_not_as_data(monkeypatch):
    offset = _clock(monkeypatch)
    summary = RunSummary(monitor=None, mode="min")
    trainer = _fit([summary.data_ready(), SlowSetup(offset), summary], offset, summary)
    assert isinstance(trainer.callbacks[0], DataReady)
    phases = summary.fit_phases(trainer)
    assert STEP / 10 <= phases["data"] < STEP, phases  # the data's set-up, and not the slow callback's
    assert phases["fit_setup"] >= STEP, phases


def test_alone_the_summary_still_marks_where_its_own_setup_runs(monkeypatch):
    offset = _clock(monkeypatch)
    summary = RunSummary(monitor=None, mode="min")
    trainer = _fit([SlowSetup(offset), summary], offset, summary)  # no DataReady: the callbacks before it count
    phases = summary.fit_phases(trainer)
    assert phases["data"] >= STEP + STEP / 10 and phases["fit_setup"] < STEP, phases
    trainer.validate(BoringModel(), datamodule=SlowData(offset), verbose=False)  # another set-up round: no error


def test_the_runner_puts_data_ready_first(make_cfg):
    from lit_speed.run.runner import build

    parts = build(make_cfg(["experiment=charlm_cpu", "trainer.max_steps=1", "logger=none"]))
    assert isinstance(parts["trainer"].callbacks[0], DataReady)
    assert parts["trainer"].callbacks[0].summary is parts["run_summary"]
