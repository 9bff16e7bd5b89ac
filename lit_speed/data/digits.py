"""scikit-learn's bundled 8x8 digits as a preloaded-tensor DataModule (no download, ever)."""
from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


def load_digits_tensors(val_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Return (train, val) ``TensorDataset`` of the 1797 digits, features scaled to [0, 1].

    The split is a fixed-seed permutation, so the same ``seed`` always gives the same split.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    from sklearn.datasets import load_digits  # ships inside scikit-learn; no network

    bunch = load_digits()
    x = torch.as_tensor(bunch.data, dtype=torch.float32) / 16.0
    y = torch.as_tensor(bunch.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_val = int(round(len(x) * val_fraction))
    val_idx, train_idx = perm[:n_val], perm[n_val:]
    return TensorDataset(x[train_idx], y[train_idx]), TensorDataset(x[val_idx], y[val_idx])


class DigitsDataModule(pl.LightningDataModule):
    """8x8 handwritten digits (1797 samples, 64 features, 10 classes), tensors preloaded in memory.

    Args:
        batch_size: Micro-batch size per device.
        val_fraction: Share of samples held out for validation.
        seed: Seed of the train/val split (independent of the training seed).
        num_workers: DataLoader workers. 0 is fastest here: the data is already a tensor.

    Example::

        dm = DigitsDataModule(batch_size=64)
        trainer.fit(model, datamodule=dm)
    """

    num_classes = 10
    in_features = 64

    def __init__(self, batch_size: int = 64, val_fraction: float = 0.2, seed: int = 0, num_workers: int = 0) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}")
        if num_workers < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {num_workers}")
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.train_dataset: TensorDataset | None = None
        self.val_dataset: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is None:
            self.train_dataset, self.val_dataset = load_digits_tensors(self.hparams.val_fraction, self.hparams.seed)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_dataset, batch_size=self.batch_size, shuffle=True,
                          num_workers=self.hparams.num_workers, drop_last=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_dataset, batch_size=max(self.batch_size, 256), shuffle=False,
                          num_workers=self.hparams.num_workers)

    def describe(self) -> dict[str, Any]:
        """Rows for the start-up table."""
        self.setup()
        return {"data": f"digits: {len(self.train_dataset)} train / {len(self.val_dataset)} val samples"}
