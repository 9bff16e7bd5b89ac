"""A quiet start (issue 50, item 5): no warning line from an import the run does not use, no stray folder from
Lightning's rank-1 command line, no ``weights_only`` notice when a stop signal saves.

Before: every Hugging Face run began with five lines from torchao's import (through transformers: ``Failed to load
..._C_mxfp8...so``, ``..._C_cutlass_90a.abi3.so``, ``Detected no triton``, and torch's two ``register_constant() on
Enum subclasses is deprecated``); a 2-process DDP run left an empty folder named ``"`` in the folder it was started
from (Lightning passes ``hydra.run.dir="<dir>"`` to rank 1, and the pre-flight created the raw text before Hydra
unquoted it).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lit_speed.run.config_check import check_output_dirs
from tests.helpers.fault_scripts.runs import ROOT, env, explain

NOISE = ("Failed to load", "_C_mxfp8", "Detected no triton", "register_constant() on Enum subclasses",
         "`weights_only` was not set")


@pytest.mark.slow  # 10-28 s: the default tier stays near 10 minutes on 2 cores
def test_a_hugging_face_run_prints_no_line_from_imports_it_does_not_use(tmp_path):
    pytest.importorskip("transformers")
    from tests.helpers.tiny_hf import save_tiny_causal_lm, write_texts

    folder = save_tiny_causal_lm(tmp_path / "hf")
    (tmp_path / "texts").mkdir()
    texts = write_texts(tmp_path / "texts")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "model=hf_causal_lm", "data=text_folder",
                           f"model.pretrained={folder}", f"data.root={texts}", "data.block_size=32", "data.batch_size=2",
                           "peft=lora", "trainer.max_steps=1", "trainer.limit_val_batches=1", "logger=none",
                           "validate=false", "callbacks=none", "trainer.enable_progress_bar=false",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, explain(done)
    output = done.stdout + done.stderr
    assert not [line for line in output.splitlines() if any(n in line for n in NOISE)], explain(done)


@pytest.mark.parametrize("quoted", ['"{}"', "'{}'", "{}"])
def test_a_quoted_run_folder_is_created_as_hydra_reads_it(tmp_path, monkeypatch, quoted):
    start = tmp_path / "started_here"
    start.mkdir()
    monkeypatch.chdir(start)
    run = tmp_path / "runs" / "one run"
    check_output_dirs([f"hydra.run.dir={quoted.format(run)}"])  # what Lightning's launcher passes to rank 1
    assert run.is_dir() and list(start.iterdir()) == []


@pytest.mark.slow  # two processes (Lightning's launcher), each importing torch + Lightning
def test_a_two_process_run_leaves_nothing_in_the_folder_it_was_started_from(tmp_path):
    start = tmp_path / "started_here"
    start.mkdir()
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "trainer=ddp_cpu", "strategy=ddp",
                           "trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1",
                           "logger=none", "validate=false", "trainer.enable_progress_bar=false",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=start, env={**env(), "PWD": str(start)},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, explain(done)
    assert os.listdir(start) == [], explain(done)
    assert (Path(tmp_path) / "run" / "summary.json").is_file()
