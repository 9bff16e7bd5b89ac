"""The functional core of stop signals: the inbox, the step gate, snapshots, the deadline setting; and one
in-process stop (the multi-process runs are in ``test_faults_signals_multiprocess.py``, slow tier)."""
from __future__ import annotations

import signal
import threading
import time

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_speed.checkpointing import FaultTolerance
from lit_speed.checkpointing.stop_signals import (
    INBOX,
    SignalInbox,
    Snapshot,
    StepGate,
    keep_live_copy_rest,
    storage_ids,
)
from lit_speed.data.digits import DigitsDataModule
from lit_speed.models.mlp import MLPClassifier
from tests.helpers.fault_scripts.kill_at_step import NoteSignalAt


def test_the_inbox_keeps_the_first_signal_and_its_time():
    inbox = SignalInbox()
    inbox.handler(signal.SIGUSR1, None)
    first = inbox.received_at
    inbox.handler(signal.SIGTERM, None)
    assert inbox.signum == signal.SIGUSR1 and inbox.received_at == first and inbox.event.is_set()
    inbox.clear()
    assert inbox.signum is None and not inbox.event.is_set()


def test_a_snapshot_shares_the_weights_and_copies_everything_else():
    weight, buffer = torch.ones(3), torch.zeros(2)
    state = {"state_dict": {"w": weight.view(3), "running_mean": buffer}, "loops": {"step": 4}, "rng": [buffer[:1]]}
    snap = keep_live_copy_rest(state, storage_ids([weight]))
    assert snap["state_dict"]["w"].data_ptr() == weight.data_ptr()  # a view of a weight: kept, never copied
    buffer.add_(1.0)  # forward goes on changing buffers (BatchNorm statistics, metric states)
    assert float(snap["state_dict"]["running_mean"].sum()) == 0.0 and float(snap["rng"][0]) == 0.0
    assert snap["loops"] == {"step": 4} and snap["loops"] is not state["loops"]


def _snapshot(updates: int) -> Snapshot:
    return Snapshot(updates=updates, step=updates, checkpoint={}, rank_part={})


def test_the_gate_freezes_updates_and_lets_a_process_that_is_one_behind_catch_up():
    gate = StepGate()
    gate.before_update()
    gate.consistent(_snapshot(1))
    assert gate.freeze() == 1  # a watchdog owns the state from here: update 2 may not begin...
    entered = threading.Event()

    def main_thread() -> None:
        gate.before_update()  # blocks until the watchdog lets it go on to update 2
        entered.set()
        gate.consistent(_snapshot(2))  # and then waits here for good (the process is ended by the watchdog)

    worker = threading.Thread(target=main_thread, daemon=True)
    worker.start()
    assert not entered.wait(0.3)
    snap = gate.advance_to(2, timeout=5.0)  # ...unless another process already made update 2
    assert entered.is_set() and snap is not None and snap.updates == 2
    time.sleep(0.1)
    assert worker.is_alive()  # held after its snapshot: it writes nothing more


def test_the_gate_gives_up_when_the_update_does_not_complete_in_time():
    gate = StepGate()
    gate.before_update()  # an update in flight that never completes
    assert gate.freeze() == 1
    assert gate.advance_to(1, timeout=0.2) is None
    assert StepGate().advance_to(0, timeout=0.1) is None  # no update yet: nothing newer than the start


@pytest.mark.parametrize("bad", [-1, 0, float("inf"), True, "soon"])
def test_a_bad_deadline_is_refused_naming_the_setting_and_a_fix(bad):
    with pytest.raises(ValueError, match=r"signal_deadline_s must be a number of seconds > 0, or None to wait for "
                                         r"the running step, got .*Fix: signal_deadline_s=25"):
        FaultTolerance(signal_deadline_s=bad)


@pytest.mark.parametrize("deadline", [None, 30.0])
def test_a_signal_stops_after_that_batch_saves_it_and_exits_143(tmp_path, deadline):
    INBOX.clear()
    pl.seed_everything(0)
    model = MLPClassifier(hidden=16, depth=1, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    trainer = pl.Trainer(accelerator="cpu", max_epochs=2, limit_train_batches=6, limit_val_batches=0, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True),
                                    FaultTolerance(signal_deadline_s=deadline), NoteSignalAt(4)])
    with pytest.raises(SystemExit) as stop:
        trainer.fit(model, datamodule=DigitsDataModule(batch_size=32))
    assert stop.value.code == 128 + signal.SIGTERM
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == 4
    assert INBOX.signum is None  # honoured: a later fit in this process starts clean


@pytest.mark.parametrize("deadline", [None, 30.0])
def test_a_run_resumed_from_a_stop_before_its_first_checkpoint_keeps_writing_last_ckpt(tmp_path, deadline):
    """The stop at step 4 came before ModelCheckpoint's first own save: the resumed run went on in last-v1.ckpt and
    left last.ckpt at step 4, so the next ``ckpt_path=last`` lost everything after it (found by signal_trials.py)."""
    INBOX.clear()

    def fit(ckpt_path, *callbacks):
        pl.seed_everything(0)
        model = MLPClassifier(hidden=16, depth=1, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
        trainer = pl.Trainer(accelerator="cpu", max_epochs=2, limit_train_batches=6, limit_val_batches=0,
                             logger=False, enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=tmp_path, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt",
                                                                                   save_last=True),
                                                                   FaultTolerance(signal_deadline_s=deadline),
                                                                   *callbacks])
        trainer.fit(model, datamodule=DigitsDataModule(batch_size=32), ckpt_path=ckpt_path)

    with pytest.raises(SystemExit):
        fit(None, NoteSignalAt(4))
    fit(tmp_path / "ckpt" / "last.ckpt")
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == 12
    assert not list((tmp_path / "ckpt").glob("last-v*"))


def test_a_deadline_save_records_the_last_checkpoint_as_the_callbacks_own(tmp_path):
    from lit_speed.checkpointing.preemption import claim_last

    callback = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = pl.Trainer(accelerator="cpu", logger=False, callbacks=[callback], default_root_dir=tmp_path)
    checkpoint = {"callbacks": {callback.state_key: callback.state_dict()}}
    claim_last(trainer, tmp_path / "other.ckpt", checkpoint)
    assert checkpoint["callbacks"][callback.state_key]["last_model_path"] == ""
    claim_last(trainer, tmp_path / "last.ckpt", checkpoint)
    assert checkpoint["callbacks"][callback.state_key]["last_model_path"] == str(tmp_path / "last.ckpt")
    assert callback.last_model_path == str(tmp_path / "last.ckpt")
