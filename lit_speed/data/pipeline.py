"""Input-pipeline options shared by the DataModules: workers, pinning, whole-batch fetching, batch transforms.

Effect on this kind of workload (measured by ``benchmarks/bench_data_pipeline.py``): a small dataset kept
as tensors and served a whole batch per index (one ``tensor[indices]`` instead of ``batch_size``
``__getitem__`` calls plus a collate), with augmentation done once per batch after transfer instead of per
sample on the CPU, is several times faster than the textbook ``Dataset`` + ``DataLoader`` loop.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate


def available_cores() -> int:
    """CPU cores this process may run on (respects taskset/cgroup affinity where the OS reports it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def resolve_num_workers(value: int | str, preloaded: bool) -> int:
    """``auto``: 0 for preloaded tensors (a worker only adds IPC), else one per spare core, at most 8.

    Raises:
        ValueError: If ``value`` is neither ``"auto"`` nor an int >= 0.
    """
    if value == "auto":
        return 0 if preloaded else max(0, min(8, available_cores() - 1))
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"num_workers must be 'auto' or an int >= 0, got {value!r}")
    return value


def resolve_pin_memory(value: bool | str, trainer: Any = None) -> bool:
    """``auto``: pin host memory only when batches go to a CUDA device (pinning costs time on CPU-only runs).

    Raises:
        ValueError: If ``value`` is neither ``"auto"`` nor a bool.
    """
    if value == "auto":
        device = getattr(getattr(trainer, "strategy", None), "root_device", None)
        return device is not None and device.type == "cuda"
    if not isinstance(value, bool):
        raise ValueError(f"pin_memory must be 'auto', True or False, got {value!r}")
    return value


def check_worker_options(num_workers: int | str, persistent_workers: bool | None, prefetch_factor: int | None) -> None:
    """Refuse worker-only options next to an explicit ``num_workers=0`` (with ``auto`` they are dropped when unused).

    Raises:
        ValueError: If ``persistent_workers`` or ``prefetch_factor`` is set while ``num_workers`` is 0, or
            ``prefetch_factor`` < 1.
    """
    resolve_num_workers(num_workers, preloaded=False)  # validates the value itself
    if num_workers == 0 and (persistent_workers or prefetch_factor is not None):
        raise ValueError(f"persistent_workers={persistent_workers} and prefetch_factor={prefetch_factor} "
                         "need num_workers > 0 (they configure worker processes); set num_workers, or "
                         "persistent_workers=False and prefetch_factor=None")
    if prefetch_factor is not None and prefetch_factor < 1:
        raise ValueError(f"prefetch_factor must be >= 1 or None, got {prefetch_factor}")


def loader_kwargs(num_workers: int, pin_memory: bool, persistent_workers: bool,
                  prefetch_factor: int | None) -> dict[str, Any]:
    """Keyword arguments for ``DataLoader``; worker-only options are dropped when no worker runs."""
    kwargs: dict[str, Any] = {"num_workers": num_workers, "pin_memory": pin_memory,
                              "persistent_workers": bool(persistent_workers) and num_workers > 0}
    if prefetch_factor is not None and num_workers > 0:
        kwargs["prefetch_factor"] = prefetch_factor
    return kwargs


@dataclass(frozen=True)
class LoaderOptions:
    """The DataLoader options every lit_speed DataModule takes, checked once (``conf/data/loader.yaml`` is this block,
    composed into every ``data=`` option).

    Args:
        num_workers: Worker processes, or ``"auto"`` (0 for preloaded tensors, else one per spare core, at most 8).
        pin_memory: Page-locked host batches; ``"auto"`` pins only when training on CUDA.
        persistent_workers: Keep workers between epochs; ``None`` = whenever there are workers.
        prefetch_factor: Batches each worker loads ahead (needs workers); ``None`` = torch's default.

    Raises:
        ValueError: A ``num_workers`` that is not ``"auto"`` or an int >= 0, or worker-only options without workers.
    """

    num_workers: int | str = 0
    pin_memory: bool | str = "auto"
    persistent_workers: bool | None = None
    prefetch_factor: int | None = None

    def __post_init__(self) -> None:
        check_worker_options(self.num_workers, self.persistent_workers, self.prefetch_factor)

    def kwargs(self, preloaded: bool, trainer: Any = None) -> dict[str, Any]:
        """``DataLoader`` keyword arguments for data that is (or is not) preloaded tensors, on ``trainer``'s device."""
        workers = resolve_num_workers(self.num_workers, preloaded)
        persistent = workers > 0 if self.persistent_workers is None else self.persistent_workers
        return loader_kwargs(workers, resolve_pin_memory(self.pin_memory, trainer), persistent, self.prefetch_factor)


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` whose position resumes through its DataModule's own ``state_dict``.

    Lightning 2.6.6 (``_TrainingEpochLoop.reset``) warns on every mid-epoch resume that a loader without
    ``state_dict``/``load_state_dict`` "is not resumable". The DataModules that build this loader save their
    sampler's position themselves (:class:`~lit_speed.data.resumable.ResumableShuffle`, the curriculum's sampler)
    and Lightning restores the DataModule before the loop starts, so a resume serves exactly the batches the
    uninterrupted run serves (``tests/checkpointing/test_faults_midepoch.py``): the loader has nothing more to save,
    its own state is empty, and Lightning's warning, which would be false here, is not raised.
    """

    def state_dict(self) -> dict[str, Any]:
        return {}  # the position lives in the DataModule's state_dict, saved and restored with it

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore here (see the class docstring)."""


class BatchFetch(Dataset):
    """Index a dataset with a list of indices and get the whole batch back.

    Tensor datasets are sliced in one indexing operation (``TensorDataset`` already supports it); a
    dataset with a ``get_batch(indices)`` method uses that; anything else falls back to per-sample
    ``__getitem__`` plus ``default_collate``. Use with ``DataLoader(BatchFetch(ds), sampler=<yields lists>,
    batch_size=None)``.
    """

    def __init__(self, dataset: Dataset, per_sample: bool = False) -> None:
        self.dataset = dataset
        self.per_sample = per_sample  # always ``__getitem__`` per index plus a collate (the textbook loader)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices: list[int]) -> Any:
        if self.per_sample:
            return default_collate([self.dataset[i] for i in indices])
        if isinstance(self.dataset, TensorDataset):
            return self.dataset[torch.as_tensor(indices)]
        get_batch = getattr(self.dataset, "get_batch", None)
        if callable(get_batch):
            return get_batch(indices)
        return default_collate([self.dataset[i] for i in indices])


def preload(dataset: Dataset) -> TensorDataset:
    """Materialise a small map-style dataset of tensors into one ``TensorDataset`` held in memory."""
    if isinstance(dataset, TensorDataset):
        return dataset
    batch = default_collate([dataset[i] for i in range(len(dataset))])
    fields = batch if isinstance(batch, (tuple, list)) else [batch]
    return TensorDataset(*fields)


def truncate_sequences(batch: Any, length: int) -> Any:
    """Cut every tensor of ``batch`` with a time axis (``ndim >= 2``) to its first ``length`` positions."""
    if isinstance(batch, torch.Tensor):
        return batch[:, :length] if batch.ndim >= 2 else batch
    if isinstance(batch, (tuple, list)):
        return type(batch)(truncate_sequences(b, length) for b in batch)
    if isinstance(batch, dict):
        return {k: truncate_sequences(v, length) for k, v in batch.items()}
    return batch


def jitter_images(batch: tuple[torch.Tensor, torch.Tensor], side: int = 8, max_shift: int = 1, noise: float = 0.05,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectorised augmentation of flattened ``side x side`` images: a random shift of up to ``max_shift``
    pixels per image (zero-filled) plus Gaussian pixel noise, for the whole batch in a few tensor ops.

    Meant as a ``batch_transform`` (applied after transfer, on the device). Labels are returned unchanged.
    """
    x, y = batch
    n = x.shape[0]
    img = x.view(n, 1, side, side)
    pad = torch.nn.functional.pad(img, (max_shift,) * 4)
    shifts = torch.randint(0, 2 * max_shift + 1, (n, 2), generator=generator, device=x.device)
    rows = (shifts[:, :1] + torch.arange(side, device=x.device)).view(n, 1, side, 1).expand(n, 1, side, side + 2 * max_shift)
    out = pad.gather(2, rows)
    cols = (shifts[:, 1:] + torch.arange(side, device=x.device)).view(n, 1, 1, side).expand(n, 1, side, side)
    out = out.gather(3, cols)
    if noise:
        out = out + noise * torch.randn(out.shape, generator=generator, device=x.device)
    return out.reshape(n, side * side), y


def check_batch_transform(owner: str, transform: Any) -> Callable[[Any], Any] | None:
    """``transform`` when it is ``None`` or callable.

    Raises:
        ValueError: Anything else (a string from the command line, a number), naming ``owner``'s argument and the
            Hydra form of a function.
    """
    if transform is None or callable(transform):
        return transform
    raise ValueError(f"{owner}(batch_transform={transform!r}): must be a function batch -> batch or None, got a "
                     f"{type(transform).__name__}. Fix: a function; from Hydra a _partial_ target, e.g. "
                     "'data.batch_transform={_target_:lit_speed.data.pipeline.jitter_images,_partial_:true}' "
                     "(digits), or data.batch_transform=null")


def apply_batch_transform(transform: Callable[[Any], Any] | None, batch: Any, training: bool) -> Any:
    """Apply a batch-level transform to training batches only (validation sees the data as it is)."""
    return transform(batch) if transform is not None and training else batch
