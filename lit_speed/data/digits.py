"""scikit-learn's bundled 8x8 digits as a preloaded-tensor DataModule (no download, ever)."""
from __future__ import annotations

from typing import Any, Callable

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lit_speed.data.pipeline import BatchFetch, LoaderOptions, ResumableDataLoader, check_batch_transform
from lit_speed.data.resumable import ResumableOrderHooks, ResumableShuffle


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


class DigitsDataModule(ResumableOrderHooks, pl.LightningDataModule):
    """8x8 handwritten digits (1797 samples, 64 features, 10 classes), tensors preloaded in memory.

    Args:
        batch_size: Micro-batch size per device.
        val_fraction: Share of samples held out for validation.
        seed: Seed of the train/val split (independent of the training seed).
        num_workers, pin_memory, persistent_workers, prefetch_factor: The loader options
            (:class:`~lit_speed.data.pipeline.LoaderOptions`); 0 workers is fastest here: the data is already a tensor.
        preload: Serve each training batch with one tensor index (``True``) instead of ``batch_size``
            ``__getitem__`` calls and a collate (``False``). Same samples in the same order either way.
        batch_transform: Function ``batch -> batch`` applied to training batches after transfer to the
            device, e.g. :func:`lit_speed.data.pipeline.jitter_images` (vectorised augmentation).

    Raises:
        ValueError: If ``batch_size`` < 1 or a loader option is out of range.

    Example::

        dm = DigitsDataModule(batch_size=64)
        trainer.fit(model, datamodule=dm)
    """

    num_classes = 10
    in_features = 64
    batch_kind = "features->class"  # what model= must take (lit_speed.run_contract.BatchSource)

    def __init__(self, batch_size: int = 64, val_fraction: float = 0.2, seed: int = 0, num_workers: int | str = 0,
                 pin_memory: bool | str = "auto", persistent_workers: bool | None = None,
                 prefetch_factor: int | None = None,
                 preload: bool = True, batch_transform: Callable[[Any], Any] | None = None) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"DigitsDataModule(batch_size={batch_size!r}): batch_size must be >= 1, got {batch_size}")
        self.loader = LoaderOptions(num_workers, pin_memory, persistent_workers, prefetch_factor)
        self.save_hyperparameters(ignore=["batch_transform"])
        self.batch_size = batch_size
        self.batch_transform = check_batch_transform('DigitsDataModule', batch_transform)
        self.train_dataset: TensorDataset | None = None
        self.val_dataset: TensorDataset | None = None
        self.train_order = ResumableShuffle("digits")  # resumes mid-epoch through state_dict

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is None:
            self.train_dataset, self.val_dataset = load_digits_tensors(self.hparams.val_fraction, self.hparams.seed)

    def _loader_kwargs(self) -> dict[str, Any]:
        return self.loader.kwargs(preloaded=True, trainer=self.trainer)

    @override
    def train_dataloader(self) -> DataLoader:
        # the same draw as shuffle=True, resumable mid-epoch; preload serves a whole batch per tensor index
        sampler = self.train_order.sampler_for(len(self.train_dataset), self.batch_size, False, self.trainer)
        return ResumableDataLoader(BatchFetch(self.train_dataset, per_sample=not self.hparams.preload),
                                   sampler=sampler, batch_size=None, **self._loader_kwargs())

    @override
    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_dataset, batch_size=max(self.batch_size, 256), shuffle=False,
                          **self._loader_kwargs())

    def describe(self) -> dict[str, Any]:
        """Rows for the start-up table."""
        self.setup()
        return {"data": f"digits: {len(self.train_dataset)} train / {len(self.val_dataset)} val samples"}

