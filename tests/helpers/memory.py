"""Ground truth for the planner tests and the memory benchmark: the measured peak of a real Trainer run."""
from __future__ import annotations

import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch

from lit_speed.data.charlm import CharLMDataModule
from lit_speed.memory.activation_checkpointing import ActivationCheckpointing
from lit_speed.memory.memory_tracker import LiveTensorTracker
from lit_speed.models.gpt import GPTModule

ROOT = Path(__file__).resolve().parents[2]
CHARLM_CACHE = ROOT / ".cache" / "charlm"
TINY_GPT = {"vocab_size": 97, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128}  # experiment=charlm_cpu


def charlm_datamodule(micro_batch: int) -> CharLMDataModule:
    return CharLMDataModule(cache_dir=str(CHARLM_CACHE), block_size=TINY_GPT["block_size"], batch_size=micro_batch,
                            max_bytes=200_000)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, foreach=True)


def measured_fit_peak(precision: str, checkpointing: bool, micro_batch: int, out_dir: Path, steps: int = 2) -> int:
    """Most tensor bytes alive at once over a real ``Trainer.fit`` of ``steps`` steps on the charlm GPT.

    The tracker is entered before the model is built, so parameters, gradients, optimizer state, batches and
    activations are all counted -- the same definition of "peak" as the planner's prediction, measured
    independently of it.
    """
    dm = charlm_datamodule(micro_batch)
    dm.setup()
    callbacks = [ActivationCheckpointing(["Block"])] if checkpointing else []
    trainer = pl.Trainer(accelerator="cpu", devices=1, precision=precision, max_steps=steps, limit_val_batches=0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks, default_root_dir=out_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with LiveTensorTracker("cpu") as tracker:
            torch.manual_seed(0)
            model = GPTModule(**TINY_GPT, optimizer=adamw)
            trainer.fit(model, datamodule=dm)
    return tracker.peak_bytes
