"""A speed feature must keep the math: bf16-mixed and 16-mixed end within a stated tolerance of 32-true.

Both workloads are shrunk (digits MLP, 4 epochs; a 1-layer char GPT, 60 steps, marked slow) and run through
a real Trainer with the plugin, same seed, same data order; only the precision differs.
"""
from __future__ import annotations

import functools
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lit_speed import GuardedPrecision
from lit_speed.data.charlm import CharLMDataModule
from lit_speed.data.digits import DigitsDataModule
from lit_speed.models.gpt import GPTModule
from lit_speed.models.mlp import MLPClassifier


@functools.lru_cache(maxsize=None)  # the 32-true baseline is trained once per workload, not once per test
def final_metric(workload: str, mode: str, cache_dir: Path, seed: int = 0) -> float:
    """Train one workload in ``mode``; return its final validation metric (digits: val/acc, charlm: val/loss)."""
    pl.seed_everything(seed, workers=True)
    optimizer = functools.partial(torch.optim.AdamW, lr=3e-3)
    if workload == "digits":
        model, data, key = MLPClassifier(hidden=128, optimizer=optimizer), DigitsDataModule(batch_size=64), "val/acc"
        limits = {"max_epochs": 4}
    else:
        model = GPTModule(block_size=32, n_layer=1, n_head=2, n_embd=32, optimizer=optimizer)
        data = CharLMDataModule(str(cache_dir), block_size=32, batch_size=16, max_bytes=300_000, max_val_windows=64)
        key, limits = "val/loss", {"max_steps": 60, "limit_val_batches": 4}
    trainer = pl.Trainer(accelerator="cpu", devices=1, plugins=[GuardedPrecision(mode)], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, **limits)
    trainer.fit(model, datamodule=data)
    return float(trainer.validate(model, datamodule=data, verbose=False)[0][key])


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("charlm")


@pytest.mark.parametrize("mode", ["bf16-mixed", "16-mixed"])
def test_digits_accuracy_within_tolerance_of_fp32(mode: str, cache_dir: Path) -> None:
    fp32 = final_metric("digits", "32-true", cache_dir)
    low = final_metric("digits", mode, cache_dir)
    assert fp32 > 0.85  # the baseline learned something: the comparison means something
    # 0.03 = 11 of the 359 validation digits. Rounding matmuls to 8 (bf16) or 11 (fp16) mantissa bits changes
    # the trajectory as a different seed does: 32-true with seeds 0 and 1 ended 0.9499 vs 0.9443 (2 digits apart)
    # and bf16-mixed/16-mixed ended at 0.9499 on an AMX Xeon. 5x the seed spread leaves room for other CPUs'
    # kernels while still catching a broken cast (a real precision bug costs tens of points).
    assert abs(low - fp32) <= 0.03, f"{mode} val/acc {low:.4f} vs 32-true {fp32:.4f}"


@pytest.mark.slow  # three char-GPT fits plus a corpus build: ~45 s of CPU time on 2 cores
@pytest.mark.parametrize("mode", ["bf16-mixed", "16-mixed"])
def test_charlm_loss_within_tolerance_of_fp32(mode: str, cache_dir: Path) -> None:
    fp32 = final_metric("charlm", "32-true", cache_dir)
    low = final_metric("charlm", mode, cache_dir)
    assert fp32 < 3.0  # below the ~3.2-nat unigram baseline: it learned context, the comparison means something
    # 0.03 nats (~1% of the ~2.6-nat loss at 60 steps). The loss is computed from float32 logits (GPTModule),
    # so only the matmuls are rounded. Measured on an AMX Xeon: 32-true seeds 0/1 ended 2.6057/2.6041,
    # bf16-mixed 2.6059, 16-mixed 2.6057; the bound is wide enough for other CPUs' kernels and far below the
    # gap of a broken run (it stays near the 3.2-nat unigram level or diverges).
    assert abs(low - fp32) <= 0.03, f"{mode} val/loss {low:.4f} vs 32-true {fp32:.4f}"
