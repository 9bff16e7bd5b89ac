"""Regression data from a fixed random "teacher" network: generated in memory, no download."""
from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class TeacherDataModule(pl.LightningDataModule):
    """``x ~ N(0, I)``, ``y = tanh(x W1) w2 + noise``: a smooth target a small MLP can learn.

    Args:
        in_features: Features per sample.
        samples: Samples in total (train + validation).
        val_fraction: Share held out for validation.
        noise: Standard deviation of the target noise (the best reachable val/mse is about noise**2).
        batch_size: Micro-batch per process.
        seed: Seed of the teacher and the samples (independent of the training seed).
        num_workers: DataLoader workers.
    """

    batch_kind = "features->value"  # optional: what lit_speed pairs with a model's accepted_batch_kinds

    def __init__(self, in_features: int = 32, samples: int = 8192, val_fraction: float = 0.1, noise: float = 0.05,
                 batch_size: int = 64, seed: int = 0, num_workers: int = 0) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"TeacherDataModule(batch_size={batch_size}): batch_size must be >= 1")
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        h = self.hparams
        g = torch.Generator().manual_seed(h.seed)
        w1 = torch.randn(h.in_features, 64, generator=g) / math.sqrt(h.in_features)
        w2 = torch.randn(64, generator=g) / 8.0
        x = torch.randn(h.samples, h.in_features, generator=g)
        y = torch.tanh(x @ w1) @ w2 + h.noise * torch.randn(h.samples, generator=g)
        n_val = int(h.samples * h.val_fraction)
        self.train_set = TensorDataset(x[n_val:], y[n_val:])
        self.val_set = TensorDataset(x[:n_val], y[:n_val])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True,
                          num_workers=self.hparams.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.hparams.num_workers)
