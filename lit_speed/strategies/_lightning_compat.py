"""Every private Lightning (and DeepSpeed) detail :class:`~lit_speed.strategies.zero_strategy.ZeroStrategy` relies on.

Written against Lightning 2.6.6 and DeepSpeed 0.19.8. ``tests/strategies/test_zero_compat.py`` checks each assumption
below and fails loudly, naming the helper, when either library changes it.
"""
from __future__ import annotations

import argparse
import importlib
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import lightning.pytorch as pl

LIGHTNING_VERSION = "2.6.6"  # the version these helpers were written and tested against


def should_accumulate(trainer: "pl.Trainer") -> bool:
    """Whether Lightning will skip the optimizer step after the current batch (private fit-loop helper).

    Lightning 2.6.6: ``trainer.fit_loop._should_accumulate()``; with a strategy that handles accumulation it is
    ``not (batch_progress.current.ready % accumulate_grad_batches == 0)``.
    """
    return trainer.fit_loop._should_accumulate()


def init_deepspeed_distributed(strategy: Any) -> None:
    """Lightning 2.6.6 ``DeepSpeedStrategy._init_deepspeed_distributed``: env vars + ``deepspeed.init_distributed``."""
    strategy._init_deepspeed_distributed()


def skip_shm_comm_build() -> None:
    """Make DeepSpeed's CPU backend skip its shared-memory comm op (a ~66 s JIT build on every cold init).

    Collectives then go through plain gloo. DeepSpeed 0.19.8 calls the module-level ``build_shm_op`` from
    ``TorchBackend.__init__``; ``importlib`` is needed because ``import deepspeed.comm.torch as m`` binds the
    ``torch`` package (``deepspeed.comm`` re-exports it), and patching that silently does nothing.
    """
    module = importlib.import_module("deepspeed.comm.torch")
    module.build_shm_op = lambda: None


@contextmanager
def intercept_deepspeed_initialize(adjust: Callable[[dict[str, Any]], dict[str, Any]]) -> Iterator[None]:
    """Let ``adjust`` see and amend the keyword arguments of Lightning's ``deepspeed.initialize`` calls.

    Lightning 2.6.6 calls ``deepspeed.initialize(args=argparse.Namespace(device_rank=self.root_device.index),
    optimizer=..., ...)`` in ``_setup_model_and_optimizer`` and ``_initialize_deepspeed_inference``, importing
    ``deepspeed`` inside the function: on CPU the index is ``None`` and DeepSpeed fails on ``None >= 0``.
    Amending the call here (local rank as ``device_rank``, optimizer checks) avoids copying those methods.
    The patch lives only for the duration of the ``with`` block.
    """
    import deepspeed

    original = deepspeed.initialize

    def initialize(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **adjust(dict(kwargs)))

    deepspeed.initialize = initialize
    try:
        yield
    finally:
        deepspeed.initialize = original


def with_device_rank(kwargs: dict[str, Any], device_rank: int) -> dict[str, Any]:
    """``kwargs`` with ``args.device_rank`` set when Lightning passed ``None`` (CPU devices have no index)."""
    ds_args = kwargs.get("args")
    if isinstance(ds_args, argparse.Namespace) and getattr(ds_args, "device_rank", None) is None:
        kwargs["args"] = argparse.Namespace(**{**vars(ds_args), "device_rank": device_rank})
    return kwargs


def auto_micro_batch_size(strategy: Any) -> int:
    """The training micro-batch size for DeepSpeed's ``train_micro_batch_size_per_gpu`` (1 if unknown).

    Replaces Lightning 2.6.6 ``DeepSpeedStrategy._auto_select_batch_size``, which reads
    ``trainer.fit_loop._data_source.dataloader().batch_sampler.batch_size`` and fails when the sampler itself
    yields batches (``DataLoader(sampler=BatchSampler(...), batch_size=None)``, as charlm does).
    """
    source = strategy.lightning_module.trainer.fit_loop._data_source
    if not source.is_defined():
        return 1
    loader = source.dataloader()
    for candidate in (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None), loader):
        size = getattr(candidate, "batch_size", None)
        if isinstance(size, int) and size > 0:
            return size
    return 1
