"""Private details of DeepSpeed and of Lightning's ``DeepSpeedStrategy`` (Lightning 2.6.6, DeepSpeed 0.19.8).

DeepSpeed is imported inside the functions, so importing this module stays cheap.
"""
from __future__ import annotations

import argparse
import importlib
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from lit_speed.compat.lightning_data import train_batch_size


def init_deepspeed_distributed(strategy: Any) -> None:
    """Lightning 2.6.6 ``DeepSpeedStrategy._init_deepspeed_distributed``: env vars + ``deepspeed.init_distributed``."""
    strategy._init_deepspeed_distributed()


@contextmanager
def shm_comm_build_skipped() -> Iterator[None]:
    """Inside the ``with`` block, DeepSpeed's CPU backend skips its shared-memory comm op (a ~66 s JIT build on
    every cold init); collectives then go through plain gloo. The original is restored after the block.

    DeepSpeed 0.19.8 calls the module-level ``build_shm_op`` once, from ``TorchBackend.__init__``, which
    ``deepspeed.init_distributed`` constructs: wrap that call. ``importlib`` is needed because
    ``import deepspeed.comm.torch as m`` binds the ``torch`` package (``deepspeed.comm`` re-exports it), and
    patching that silently does nothing.
    """
    module = importlib.import_module("deepspeed.comm.torch")
    original = module.build_shm_op
    module.build_shm_op = lambda: None
    try:
        yield
    finally:
        module.build_shm_op = original


@contextmanager
def memory_readers_follow_accelerator() -> Iterator[None]:
    """Inside the ``with`` block, DeepSpeed's memory log lines read the accelerator in use now.

    DeepSpeed 0.19.8 binds two module globals of ``deepspeed.runtime.utils`` to the accelerator of import time
    (``torch_memory_reserved = get_accelerator().memory_reserved`` and ``torch_max_memory_reserved``, read by
    ``see_memory_usage``); after ``deepspeed.accelerator.set_accelerator`` they still read the old one. They are
    rebound to the current accelerator for the block and restored after it (``ZeroStrategy`` holds the block from
    its environment set-up to its teardown).
    """
    from deepspeed.accelerator import get_accelerator

    utils = importlib.import_module("deepspeed.runtime.utils")
    accelerator = get_accelerator()
    originals = utils.torch_memory_reserved, utils.torch_max_memory_reserved
    utils.torch_memory_reserved = accelerator.memory_reserved
    utils.torch_max_memory_reserved = accelerator.max_memory_reserved
    try:
        yield
    finally:
        utils.torch_memory_reserved, utils.torch_max_memory_reserved = originals


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


class BatchSizeFromLoader:
    """Mixin for a ``DeepSpeedStrategy`` subclass: DeepSpeed's ``train_micro_batch_size_per_gpu`` from the
    train loader's ``batch_sampler``, ``sampler`` or the loader itself.

    Overrides Lightning 2.6.6's private hook ``DeepSpeedStrategy._auto_select_batch_size`` (called from
    ``_format_batch_size_and_grad_accum_config``), which fails when the sampler itself yields batches.
    """

    def _auto_select_batch_size(self) -> int:
        return train_batch_size(self.lightning_module.trainer)  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------- checkpoint parts
def zero_checkpoint_tag() -> str:
    """The tag Lightning 2.6.6's ``DeepSpeedStrategy.save_checkpoint`` saves under (``tag="checkpoint"``)."""
    return "checkpoint"


def write_zero_optimizer_part(engine: Any, folder: str, tag: str) -> str:
    """Write this process's optimizer shard into ``folder/tag/`` as DeepSpeed 0.19.8's ``engine.save_checkpoint``
    does (``_save_zero_checkpoint``: ``{optimizer_state_dict, ds_config, ds_version}`` under ``_get_zero_ckpt_name``),
    without its barriers and tag check: a collective-free write for one process. Returns the file."""
    import torch
    from deepspeed import version

    path = engine._get_zero_ckpt_name(folder, tag)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(dict(optimizer_state_dict=engine.optimizer.state_dict(), ds_config=engine.config, ds_version=version),
               path)
    return path


def write_zero_model_states(engine: Any, folder: str, tag: str, module_state: dict[str, Any],
                            client_state: dict[str, Any]) -> str:
    """Write the model-states file of ``folder/tag/`` as DeepSpeed 0.19.8's ``_save_checkpoint`` does on the process
    that writes it (``save_non_zero_checkpoint``), with a module state dict taken earlier. Returns the file."""
    import torch

    path = engine._get_ckpt_name(folder, tag)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_frozen = engine.zero_optimization_partition_gradients()
    state = engine._common_checkpoint_state(module_state, engine.zero_optimization(), save_frozen)
    state.update(client_state)
    torch.save(state, path)
    return path
