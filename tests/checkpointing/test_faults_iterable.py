"""A foreign project's infinite ``IterableDataset`` that draws from a global RNG resumes mid-epoch exactly.

The setup of issue 16, shrunk: a plain LightningModule trained on windows drawn with ``np.random.randint``
(or Python's ``random``, or torch's RNG), a checkpoint mid-epoch, a resume. Lightning prefetches an unsized
loader one batch ahead, so the RNG state at the checkpoint is one batch past what training used: before,
one resumed batch was a repeat and the weights differed. ``FaultTolerance`` now also saves the state from
before that fetch and draws the prefetched batch again from it. In worker processes it cannot (their RNG
streams are in no checkpoint): the resume says so in one line.
"""
from __future__ import annotations

import random

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, IterableDataset

from lit_speed.checkpointing import FaultTolerance

TEXT = torch.arange(500) % 37
BLOCK, STEPS, CKPT_STEP = 8, 12, 6


class RandomWindows(IterableDataset):
    """Endless training windows at random offsets drawn from one global RNG (numpy, python or torch)."""

    def __init__(self, rng: str) -> None:
        self.rng = rng

    def _offset(self) -> int:
        high = len(TEXT) - BLOCK - 1
        if self.rng == "numpy":
            return int(np.random.randint(0, high))
        if self.rng == "python":
            return random.randrange(high)
        return int(torch.randint(high, ()))

    def __iter__(self):
        while True:
            i = self._offset()
            yield TEXT[i:i + BLOCK], TEXT[i + 1:i + BLOCK + 1]


class TinyLM(pl.LightningModule):
    def __init__(self, rng: str, workers: int = 0) -> None:
        super().__init__()
        self.rng, self.workers = rng, workers
        self.emb, self.head = torch.nn.Embedding(37, 16), torch.nn.Linear(16, 37)
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append(x.clone())
        return torch.nn.functional.cross_entropy(self.head(self.emb(x)).flatten(0, 1), y.flatten())

    def train_dataloader(self):
        return DataLoader(RandomWindows(self.rng), batch_size=4, num_workers=self.workers)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(root, rng, max_steps, ckpt_path=None, workers=0):
    pl.seed_everything(0)
    model = TinyLM(rng, workers)
    trainer = pl.Trainer(max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         deterministic=True, default_root_dir=root,
                         callbacks=[ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=CKPT_STEP, save_last=True),
                                    FaultTolerance()])
    trainer.fit(model, ckpt_path=ckpt_path)
    return model


@pytest.mark.parametrize("rng", ["numpy", "python", "torch"])
def test_iterable_dataset_on_a_global_rng_resumes_mid_epoch_bitwise(tmp_path, rng):
    reference = _fit(tmp_path / "reference", rng, STEPS)
    _fit(tmp_path / "run", rng, CKPT_STEP)  # stopped (preempted) right after its mid-epoch checkpoint
    resumed = _fit(tmp_path / "run", rng, STEPS, ckpt_path=str(tmp_path / "run" / "ckpt" / "last.ckpt"))
    equal = [torch.equal(a, b) for a, b in zip(resumed.seen, reference.seen[CKPT_STEP:])]
    assert len(resumed.seen) == STEPS - CKPT_STEP and all(equal), f"{sum(equal)}/{len(equal)} batches equal"
    for (name, a), b in zip(reference.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


def test_iterable_dataset_in_workers_says_at_resume_that_it_is_not_exact(tmp_path):
    _fit(tmp_path / "run", "numpy", CKPT_STEP, workers=1)
    with pytest.warns(UserWarning, match=r"mid-epoch resume is not exact: RandomWindows is an IterableDataset read "
                                         r"in 1 worker process\(es\).*Fix: num_workers=0"):
        _fit(tmp_path / "run", "numpy", CKPT_STEP + 2, ckpt_path=str(tmp_path / "run" / "ckpt" / "last.ckpt"), workers=1)


def test_a_plain_shuffled_loader_says_at_resume_that_it_is_not_exact(tmp_path):
    class Shuffled(TinyLM):
        def train_dataloader(self):
            windows = [(TEXT[i:i + BLOCK], TEXT[i + 1:i + BLOCK + 1]) for i in range(0, 400, BLOCK)]
            return DataLoader(windows, batch_size=4, shuffle=True)

    def fit(max_steps, ckpt_path=None):
        pl.seed_everything(0)
        trainer = pl.Trainer(max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=tmp_path, callbacks=[
                                 ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=CKPT_STEP, save_last=True),
                                 FaultTolerance()])
        trainer.fit(Shuffled("numpy"), ckpt_path=ckpt_path)

    fit(CKPT_STEP)
    with pytest.warns(UserWarning, match=r"mid-epoch resume is not exact: the loader of list restarts its epoch "
                                         r"with RandomSampler.*Fix: a sampler with state_dict"):
        fit(CKPT_STEP + 2, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))


class ValidatedLM(TinyLM):
    """nanoGPT's setup: training *and* validation batches drawn from the same global numpy RNG, the
    checkpoint written by ``ModelCheckpoint(monitor="val_loss")`` after each validation."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.head(self.emb(x)).flatten(0, 1), y.flatten()))

    def val_dataloader(self):
        return DataLoader(RandomWindows(self.rng), batch_size=4)


VAL_EVERY, VAL_STOP, VAL_STEPS = 6, 9, 14  # checkpoints at validation (steps 6, 12); stopped at 9, resumed from 6


def _fit_validated(root, max_steps, ckpt_path=None, restore_rng=True):
    pl.seed_everything(0)
    model = ValidatedLM("numpy")
    trainer = pl.Trainer(max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         deterministic=True, default_root_dir=root, val_check_interval=VAL_EVERY,
                         check_val_every_n_epoch=None, limit_val_batches=3, num_sanity_val_steps=0,
                         callbacks=[ModelCheckpoint(dirpath=root / "ckpt", monitor="val_loss", save_last=True),
                                    FaultTolerance(restore_rng=restore_rng)])
    trainer.fit(model, ckpt_path=ckpt_path)
    return model


@pytest.mark.parametrize("restore_rng", [True, False], ids=["rng-saved", "rng-not-saved"])
def test_checkpoint_written_at_validation_resumes_bitwise_although_validation_drew_from_the_same_rng(tmp_path,
                                                                                                  restore_rng):
    # the prefetched training batch was drawn *before* validation drew its 3 batches: the resume draws it again
    # from the state before that fetch, then goes on from the state after validation, as the uninterrupted run did
    reference = _fit_validated(tmp_path / "reference", VAL_STEPS)
    _fit_validated(tmp_path / "run", VAL_STOP, restore_rng=restore_rng)  # killed between two validations
    resumed = _fit_validated(tmp_path / "run", VAL_STEPS, ckpt_path=str(tmp_path / "run" / "ckpt" / "last.ckpt"),
                             restore_rng=restore_rng)
    equal = [torch.equal(a, b) for a, b in zip(resumed.seen, reference.seen[VAL_EVERY:])]
    assert len(resumed.seen) == VAL_STEPS - VAL_EVERY
    same_weights = all(torch.equal(a, b) for a, b in zip(reference.parameters(), resumed.parameters()))
    if restore_rng:
        assert all(equal) and same_weights, f"{sum(equal)}/{len(equal)} batches equal"
    else:  # the control: without the saved RNG the same resume is not exact (so the test above can fail)
        assert not all(equal) and not same_weights
