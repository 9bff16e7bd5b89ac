"""Every line the run prints is true (issue 33, items 5-9): each start-up row is read from a real run and checked
against what that run did; the verdict advises only about what is on; nothing printed on every run that the user
did not ask for and cannot act on.
"""
from __future__ import annotations

import csv
import os
import re
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import Callback

from lit_speed.monitoring.diagnosis import RunStats, diagnose
from lit_speed.run.runner import train
from tests.helpers.repo import ROOT, run_train_script

QUIET = ["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "validate=false",
         "trainer.num_sanity_val_steps=0"]


def _rows(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(path.open()))


class ValidationSteps(Callback):
    """Records ``trainer.global_step`` at every validation of the fit (the sanity check excluded)."""

    seen: list[int] = []

    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not trainer.sanity_checking:
            ValidationSteps.seen.append(trainer.global_step)


RECORD = ["+callbacks.record._target_=tests.run.test_startup_table.ValidationSteps"]


@pytest.fixture(autouse=True)
def _fresh_record():
    ValidationSteps.seen = []


# ---- item 5: the effective batch at the start and where the schedule goes ----------------------------------------
def test_the_effective_batch_row_is_the_schedule_the_run_follows(make_cfg, tmp_path):
    # before: "64 micro x 1 accumulation x 1 process(es) = 64" although the schedule started at 128
    summary = train(make_cfg(["accumulation=ramp", "accumulation.factors=null",
                              "accumulation.effective_batch=[[0,128],[4,256]]", "accumulation.ramp=step", "trainer.max_steps=6", "trainer.log_every_n_steps=1",
                              "callbacks=none", *QUIET]))
    assert summary["startup"]["effective batch"] == ("64 micro x 2 accumulation x 1 process(es) = 128 at the start; "
                                                     "then 256 (x4) at step 4")
    logged = {int(r["step"]): float(r["accumulation/effective_batch"])
              for r in _rows(tmp_path / "csv" / "metrics.csv") if r.get("accumulation/effective_batch")}
    assert logged[0] == 128 and logged[3] == 128 and logged[4] == 256 and logged[5] == 256


def test_a_linear_ramp_row_says_it_rises_between_the_keys(make_cfg):
    summary = train(make_cfg(["accumulation=ramp", "trainer.max_steps=1", "callbacks=none", "logger=none", *QUIET]))
    assert summary["startup"]["effective batch"] == ("64 micro x 1 accumulation x 1 process(es) = 64 at the start; "
                                                     "rising linearly (whole micro-batches) to x4 = 256 at step 50")


# ---- item 5: what val_check_interval counts, and a cadence in optimizer steps ---------------------------------------
def test_the_validation_row_says_val_check_interval_counts_micro_batches(make_cfg):
    summary = train(make_cfg(["accumulation=fixed", "accumulation.factors=[[0,4]]", "trainer.val_check_interval=8",
                              "trainer.check_val_every_n_epoch=null", "trainer.max_steps=6", "trainer.limit_train_batches=16",
                              "trainer.limit_val_batches=1",
                              "callbacks=none", "logger=none", *RECORD, *QUIET]))
    row = summary["startup"]["validation"]
    assert row.startswith("every 8 training batches counted across epochs (trainer.val_check_interval): training "
                          "batches are micro-batches, so under x4 accumulation that is every ~2 optimizer steps; "
                          "to count optimizer steps: 'callbacks=[default,validate_every_n_steps]'")
    assert ValidationSteps.seen == [2, 4, 6]  # what the row says: every 8 micro-batches = every 2 optimizer steps


def test_validate_every_n_steps_validates_at_the_optimizer_steps_its_row_names(make_cfg):
    # a ramp: 1, 2, then 4 micro-batches per step; every 3 steps whatever the window
    summary = train(make_cfg(["accumulation=ramp", "accumulation.factors=null",
                              "accumulation.effective_batch=[[0,64],[2,128],[4,256]]",
                              "accumulation.ramp=step", "trainer.max_steps=9", "trainer.limit_val_batches=1",
                              "callbacks=[validate_every_n_steps]", "callbacks.validate_every_n_steps.every_n_steps=3",
                              "logger=none", *RECORD, *QUIET]))
    assert summary["startup"]["validation"].startswith("every 3 optimizer steps (ValidateEveryNSteps;")
    assert ValidationSteps.seen == [3, 6, 9]


def test_validate_every_n_steps_refuses_a_cadence_it_would_override(make_cfg):
    from lit_speed.run.config_error import ConfigError

    with pytest.raises(ConfigError, match=r"^callbacks\.validate_every_n_steps: ValidateEveryNSteps: Trainer\("
                                          r"val_check_interval=5\) would be ignored: every_n_steps=3 decides when to "
                                          r"validate\. Fix: trainer\.val_check_interval=null$"):
        train(make_cfg(["callbacks=[validate_every_n_steps]", "callbacks.validate_every_n_steps.every_n_steps=3",
                        "trainer.val_check_interval=5", "trainer.max_steps=2", "logger=none", *QUIET]))


# ---- item 6: ZeRO rows count the frozen base every rank holds -------------------------------------------------------
def test_the_zero_row_counts_the_frozen_base(make_cfg):
    from lit_speed.strategies.memory_estimate import format_bytes

    summary = train(make_cfg(["strategy=zero2", "peft=lora", "peft.export=false", "trainer.accelerator=cpu",
                              "trainer.max_steps=1", "trainer.limit_val_batches=1", "callbacks=none", "logger=none",
                              *QUIET]))
    peft = summary["components"]["PEFTAdapters"]
    trainable, total = peft["trainable_params"], peft["total_params"]
    row = summary["startup"]["zero model states / rank"]
    # 32-true under DeepSpeed: 4 bytes per parameter, every parameter (trainable and frozen) on the one rank
    assert row.startswith(f"{trainable:,} trainable + {total - trainable:,} frozen parameters: params "
                          f"{format_bytes(4 * total)} + grads {format_bytes(4 * trainable)} + "), row


# ---- item 7: messages named after the data module in use; no false "not resumable" warning -------------------------
def test_a_resumed_text_folder_run_names_its_data_module_and_lightning_does_not_call_it_unresumable(
        make_cfg, tmp_path, monkeypatch):
    from tests.helpers.tiny_hf import STDLIB, save_tiny_causal_lm

    folder = save_tiny_causal_lm(tmp_path / "hf", "llama", hidden=32, layers=1)
    run = ["model=hf_causal_lm", "data=text_folder", f"model.pretrained={folder}", f"data.root={STDLIB / 'json'}",
           "data.block_size=32", "callbacks=model_checkpoint", "callbacks.model_checkpoint.every_n_train_steps=2",
           "trainer.limit_val_batches=1", "logger=none", *QUIET]
    train(make_cfg([*run, "trainer.max_steps=2"]))
    said = []
    monkeypatch.setattr("lit_speed.data.resumable.rank_zero_info", said.append)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = train(make_cfg([*run, "trainer.max_steps=4", "ckpt_path=last"]))
    assert summary["global_step"] == 4
    assert said == ["text_folder training order resumed at epoch 0, batch 2"]
    assert not [w for w in caught if "not resumable" in str(w.message)], "Lightning's false warning came back"


# ---- item 8: the verdict advises only about what is on --------------------------------------------------------------
ROOMY = dict(data_wait_s=0.1, forward_backward_s=1.0, optimizer_s=0.1, batches=10, memory_peak_bytes=1e9,
             memory_capacity_bytes=10e9)
TIGHT = {**ROOMY, "memory_peak_bytes": 9.5e9}


@pytest.mark.parametrize("checkpointing", [False, True, None])
def test_memory_advice_names_activation_checkpointing_only_as_it_is(checkpointing):
    roomy = diagnose(RunStats(**ROOMY, activation_checkpointing=checkpointing))["findings"][-1]["next_step"]
    tight = diagnose(RunStats(**TIGHT, activation_checkpointing=checkpointing))["findings"][-1]["next_step"]
    assert ("turn off activation checkpointing" in roomy) == bool(checkpointing)
    assert ("activation checkpointing" in tight) == (not checkpointing)
    assert roomy.startswith("grow data.batch_size") and "ZeRO-3 or offload" in tight


def test_a_run_without_activation_checkpointing_is_not_told_to_turn_it_off(make_cfg, tmp_path):
    import json

    train(make_cfg(["trainer.max_epochs=1", "trainer.limit_train_batches=4", "trainer.limit_val_batches=1",
                    "callbacks=device_stats", "logger=none", *QUIET]))
    verdict = json.loads((tmp_path / "bottleneck.json").read_text())
    assert verdict["evidence"]["activation_checkpointing"] is False
    assert "activation checkpointing" not in json.dumps(verdict["findings"]).replace(
        "activation checkpointing, ZeRO-3", "")  # memory-tight may suggest turning it on


def test_a_run_with_activation_checkpointing_knows_it_is_on(make_cfg, tmp_path):
    import json

    train(make_cfg(["trainer.max_epochs=1", "trainer.limit_train_batches=4", "trainer.limit_val_batches=1",
                    "callbacks=[device_stats,activation_checkpointing]",
                    "callbacks.activation_checkpointing.modules=[Sequential]", "logger=none", *QUIET]))
    assert json.loads((tmp_path / "bottleneck.json").read_text())["evidence"]["activation_checkpointing"] is True


# ---- item 9: nothing printed on every run that the user did not ask for and cannot act on ---------------------------
def test_a_default_run_prints_no_tip_and_no_deprecation(tmp_path):
    proc = run_train_script(["trainer.max_epochs=1", "trainer.limit_train_batches=3", "trainer.limit_val_batches=1",
                             f"hydra.run.dir={tmp_path}"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert "lit_speed summary" in proc.stdout  # the run happened, and printed its tables
    for unasked in (r"litlogger", r"\btip\b", r"deprecat"):
        found = re.findall(rf".*{unasked}.*", output, flags=re.I)
        assert not found, f"{unasked!r} printed on a default run: {found}"


def test_installing_prints_no_setuptools_deprecation():
    # setuptools (>= 77) deprecates project.license as a table; the SPDX string form is read without a warning
    setuptools = pytest.importorskip("setuptools")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} reads no SPDX license strings (pyproject asks for >= 77)")
    cwd = os.getcwd()
    os.chdir(ROOT)  # readme = "README.md" is read relative to the project
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            apply_configuration(Distribution(), ROOT / "pyproject.toml")
    finally:
        os.chdir(cwd)
    assert not [str(w.message) for w in caught], [str(w.message)[:200] for w in caught]
