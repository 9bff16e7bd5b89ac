"""A DataModule that shows the easiest fraction of the training set first and widens it to the full set."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lit_speed.curriculum.difficulty import difficulty_order, resolve_scores
from lit_speed.curriculum.pacing import check_pacing, pacing_fraction, progress_at, seq_len_at
from lit_speed.curriculum.sampler import CurriculumSampler
from lit_speed.data.pipeline import (
    BatchFetch,
    LoaderOptions,
    ResumableDataLoader,
    apply_batch_transform,
    check_batch_transform,
    truncate_sequences,
)

PACE_UNITS = ("steps", "epochs")


class CurriculumDataModule(pl.LightningDataModule):
    """Serve, at each training batch, only the easiest allowed share of the training set; widen to all of it.

    Wraps a DataModule (its ``train_dataset``/``val_dataset`` after ``setup``) or a pair of map-style datasets.
    Batches come from :class:`~lit_speed.curriculum.sampler.CurriculumSampler`: deterministic given ``seed``,
    one disjoint shard of the allowed set per DDP rank, and resumable mid-epoch (its position is saved in the
    checkpoint through this module's ``state_dict``). "Steps" are training batches of this rank (optimizer
    steps times gradient accumulation).

    Args:
        datamodule: A DataModule to wrap (its validation loader is used as is).
        train_dataset: Training set, when no ``datamodule`` is given.
        val_dataset: Validation set, when no ``datamodule`` is given.
        batch_size: Samples per batch; defaults to the wrapped DataModule's ``batch_size``.
        difficulty: ``none`` | ``length`` | ``centroid`` | ``loss``, one score per sample, or ``sample -> float``.
        reference_model: Model for ``difficulty="loss"``.
        pacing: ``linear`` | ``root`` | ``step`` | ``exponential`` | ``none`` (see :mod:`~lit_speed.curriculum.pacing`).
        start_fraction: Share of the easiest samples allowed at the first batch.
        pace_duration: Length of the widening phase, in ``pace_unit``; the full set is used from then on.
        pace_unit: ``steps`` (training batches) or ``epochs`` (full-data epochs).
        pace_stages: Number of jumps of the ``step`` pacing.
        seq_len_start: Sequence-length warm-up: the first batches are cut to this many positions (``None`` = off).
        seq_len_warmup: Training batches over which the length grows linearly to the full length.
        seq_len_multiple: Warm-up lengths are rounded down to a multiple of this.
        seed: Seed of the difficulty tie-breaking and of every epoch's shuffle.
        drop_last: Drop each epoch's last, smaller batch.
        num_workers, pin_memory, persistent_workers, prefetch_factor: The loader options
            (:class:`~lit_speed.data.pipeline.LoaderOptions`).
        batch_transform: Function ``batch -> batch`` applied to training batches after transfer to the device.
        block_size: Full sequence length of the warm-up; defaults to the wrapped DataModule's ``block_size``.

    Raises:
        ValueError: On a missing or doubled data source, or a pacing/warm-up setting out of range.

    Example::

        dm = CurriculumDataModule(DigitsDataModule(batch_size=64), difficulty="centroid",
                                  pacing="linear", start_fraction=0.3, pace_duration=100)
        trainer = pl.Trainer(max_steps=300, callbacks=[CurriculumEarlyStopping("val/acc", mode="max")])
        trainer.fit(model, datamodule=dm)
    """

    def __init__(self, datamodule: pl.LightningDataModule | None = None, train_dataset: Dataset | None = None,
                 val_dataset: Dataset | None = None, batch_size: int | None = None,
                 difficulty: str | Sequence[float] | Callable[[Any], float] = "none", reference_model: Any = None,
                 pacing: str = "linear", start_fraction: float = 0.25, pace_duration: int = 0,
                 pace_unit: str = "steps", pace_stages: int = 4, seq_len_start: int | None = None,
                 seq_len_warmup: int = 0, seq_len_multiple: int = 8, seed: int = 0, drop_last: bool = False,
                 num_workers: int | str = 0, pin_memory: bool | str = "auto", persistent_workers: bool | None = None,
                 prefetch_factor: int | None = None, batch_transform: Callable[[Any], Any] | None = None,
                 block_size: int | None = None) -> None:
        super().__init__()
        if (datamodule is None) == (train_dataset is None):
            raise ValueError("CurriculumDataModule needs exactly one data source: datamodule=<a DataModule> or "
                             "train_dataset=<a map-style Dataset> (+ val_dataset), got "
                             f"datamodule={type(datamodule).__name__}, train_dataset={type(train_dataset).__name__}")
        batch_size = batch_size if batch_size is not None else getattr(datamodule, "batch_size", None)
        if batch_size is None or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1 (or taken from the wrapped datamodule), got {batch_size}")
        check_pacing(pacing, start_fraction, pace_stages)
        if pace_unit not in PACE_UNITS:
            raise ValueError(f"pace_unit must be one of {PACE_UNITS}, got {pace_unit!r}")
        if pacing != "none" and pace_duration <= 0:
            raise ValueError(f"pacing={pacing!r} widens over pace_duration {pace_unit}, got pace_duration="
                             f"{pace_duration}; set pace_duration > 0, or pacing=none")
        if seq_len_start is not None and seq_len_warmup <= 0:
            raise ValueError(f"seq_len_start={seq_len_start} needs seq_len_warmup > 0 (batches of the warm-up), "
                             f"got {seq_len_warmup}; set it, or seq_len_start=null")
        self.loader = LoaderOptions(num_workers, pin_memory, persistent_workers, prefetch_factor)
        self.datamodule, self.train_dataset, self.val_dataset = datamodule, train_dataset, val_dataset
        self.batch_size = batch_size
        self.difficulty, self.reference_model = difficulty, reference_model
        self.pacing, self.start_fraction, self.pace_stages = pacing, start_fraction, pace_stages
        self.pace_duration, self.pace_unit = pace_duration, pace_unit
        self.seq_len_start, self.seq_len_warmup, self.seq_len_multiple = seq_len_start, seq_len_warmup, seq_len_multiple
        self.seed, self.drop_last = seed, drop_last
        self.batch_transform = check_batch_transform('CurriculumDataModule', batch_transform)
        self.sampler: CurriculumSampler | None = None
        inner = getattr(datamodule, "block_size", None)
        if block_size is not None and inner is not None and block_size != inner:
            raise ValueError(f"CurriculumDataModule(block_size={block_size}): block_size={block_size} differs from "
                             f"the wrapped datamodule's block_size={inner}; set one value (or leave block_size=None "
                             "to take the wrapped datamodule's)")
        self.block_size = block_size if block_size is not None else inner
        self.full_seq_len: int | None = self.block_size
        self._pending_state: dict[str, Any] | None = None

    @override
    def prepare_data(self) -> None:
        if self.datamodule is not None:
            self.datamodule.prepare_data()

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.datamodule is not None:
            self.datamodule.setup(stage)
            self.train_dataset = self.datamodule.train_dataset
            self.val_dataset = self.datamodule.val_dataset
        if self.sampler is not None or self.train_dataset is None:
            return
        if self.seq_len_start is not None and self.full_seq_len is not None and self.seq_len_start > self.full_seq_len:
            raise ValueError(f"seq_len_start must be <= block_size={self.full_seq_len}, got {self.seq_len_start}")
        scores = resolve_scores(self.difficulty, self.train_dataset, self.reference_model)
        order = difficulty_order(scores, len(self.train_dataset), self.seed)
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer is not None else (0, 1)
        self.sampler = CurriculumSampler(order, self.batch_size, self.fraction_at, self.seed, rank, world, self.drop_last)
        if self._pending_state is not None:
            self.sampler.load_state_dict(self._pending_state)

    @property
    def pace_batches(self) -> int:
        """Length of the widening phase in training batches."""
        if self.pace_unit == "steps":
            return int(self.pace_duration)
        return int(round(self.pace_duration * (self.sampler.batches_per_epoch if self.sampler else 0)))

    def fraction_at(self, global_batch: int) -> float:
        """Allowed share of the training set at training batch ``global_batch`` (0-based, across epochs)."""
        return pacing_fraction(self.pacing, progress_at(global_batch, self.pace_batches), self.start_fraction,
                               self.pace_stages)

    def seq_len_at(self, global_batch: int) -> int | None:
        if self.seq_len_start is None or self.full_seq_len is None:
            return None
        return seq_len_at(global_batch, self.seq_len_start, self.full_seq_len, self.seq_len_warmup, self.seq_len_multiple)

    @property
    def batches_seen(self) -> int:
        return self.sampler.consumed_total if self.sampler is not None else 0

    @property
    def is_widening(self) -> bool:
        """True while the last training batch came from a restricted set or a shortened sequence length.

        Early stopping holds off while this is true: the model evaluated was trained on the easy part only.
        """
        g = max(self.batches_seen - 1, 0)
        length = self.seq_len_at(g)
        return self.fraction_at(g) < 1.0 or (length is not None and length < self.full_seq_len)

    def _loader_kwargs(self, preloaded: bool) -> dict[str, Any]:
        return self.loader.kwargs(preloaded, self.trainer)

    @override
    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        preloaded = isinstance(self.train_dataset, torch.utils.data.TensorDataset)
        return ResumableDataLoader(BatchFetch(self.train_dataset), sampler=self.sampler, batch_size=None,
                                   **self._loader_kwargs(preloaded))

    @override
    def val_dataloader(self) -> Any:
        if self.datamodule is not None:
            return self.datamodule.val_dataloader()
        return DataLoader(self.val_dataset, batch_size=self.batch_size, shuffle=False, **self._loader_kwargs(False))

    @override
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        training = self.trainer is not None and self.trainer.training
        if training and self.sampler is not None:
            g = self.sampler.consumed_total
            self.sampler.mark_consumed()
            if self.full_seq_len is None and self.seq_len_start is not None:
                self.full_seq_len = int(batch[0].shape[1])
            length = self.seq_len_at(g)
            if length is not None:
                batch = truncate_sequences(batch, length)
        return apply_batch_transform(self.batch_transform, batch, training)

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.sampler is None:
            return {}
        state = self.sampler.state_dict()
        limit = getattr(self.trainer, "num_training_batches", None) if self.trainer is not None else None
        limit = self.sampler.batches_per_epoch if not isinstance(limit, int) else limit
        state["epoch_done"] = state["batch_in_epoch"] >= limit
        state["train_size"] = len(self.sampler.order)
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.sampler is None:
            self._pending_state = dict(state_dict)
            return
        saved = state_dict.get("train_size", len(self.sampler.order))
        if saved != len(self.sampler.order):
            raise ValueError(f"the checkpoint's curriculum was over {saved} training samples, this data has "
                             f"{len(self.sampler.order)}; resume with the same data settings")
        self.sampler.load_state_dict(state_dict)
        rank_zero_info(f"curriculum resumed at epoch {self.sampler.consumed_epoch}, batch "
                       f"{self.sampler.consumed_in_epoch} ({self.sampler.consumed_total} batches seen)")

    def describe(self) -> dict[str, str]:
        """Rows for the start-up table."""
        rows = dict(self.datamodule.describe()) if hasattr(self.datamodule, "describe") else {}
        name = self.difficulty if isinstance(self.difficulty, str) else type(self.difficulty).__name__
        rows["curriculum"] = ("off (pacing=none)" if self.pacing == "none" else
                              f"{name} difficulty, {self.pacing} pacing {self.start_fraction:.0%} -> 100% over "
                              f"{self.pace_duration} {self.pace_unit}")
        if self.seq_len_start is not None:
            rows["seq-len warm-up"] = f"{self.seq_len_start} -> {self.full_seq_len or 'full'} over {self.seq_len_warmup} batches"
        return rows
