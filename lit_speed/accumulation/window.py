"""Token-correct loss normalisation over an accumulation window, as plain functions on tensors.

The contract with the LightningModule: ``training_step`` returns the *mean* loss over the items of its
micro-batch (what ``F.cross_entropy(..., ignore_index=-100)`` already returns), and the items are
counted from the batch itself:

* ``samples``: the first dimension of the batch's first tensor;
* ``tokens``: targets that are not ``ignore_index`` (the targets are the last tensor of a tuple/list
  batch, or ``batch["labels"]`` / ``batch["targets"]`` of a dict batch);
* ``micro_batch``: every micro-batch counts as one item (the classic mean of micro-batch means).

Backpropagating ``items_i * mean_i`` (the micro-batch's *summed* loss) for every micro-batch and dividing
the accumulated gradient once by the total item count of the window (summed over processes) gives
exactly the gradient of ``sum(per-item losses) / items`` over the whole window, whatever the window's
length, padding or raggedness.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from lit_speed.compat import torch as torch_compat

NORMALIZE = ("samples", "tokens", "micro_batch")
_TARGET_KEYS = ("labels", "targets", "target", "y")


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [v for v in batch.values() if isinstance(v, torch.Tensor)]
    if isinstance(batch, (list, tuple)):
        return [t for item in batch for t in _tensors(item)]
    return []


def batch_samples(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (0 if it holds no tensor)."""
    tensors = _tensors(batch)
    return int(tensors[0].shape[0]) if tensors and tensors[0].dim() > 0 else 0


def batch_targets(batch: Any) -> torch.Tensor:
    """The target tensor of a batch: the last tensor of a tuple/list, or a ``labels``-like key of a dict.

    Raises:
        ValueError: If no target tensor can be found.
    """
    if isinstance(batch, dict):
        for key in _TARGET_KEYS:
            if isinstance(batch.get(key), torch.Tensor):
                return batch[key]
        raise ValueError(f"AccumulationScheduler(normalize='tokens'): normalize='tokens' needs the targets in "
                         f"batch[{'|'.join(_TARGET_KEYS)}], got keys {list(batch)}; rename the key or use "
                         "normalize='samples'")
    tensors = _tensors(batch)
    if not tensors:
        raise ValueError("AccumulationScheduler(normalize='tokens'): normalize='tokens' needs a batch holding "
                         "tensors, got "
                         f"{type(batch).__name__}; use normalize='micro_batch'")
    return tensors[-1]


def count_items(batch: Any, normalize: str, ignore_index: int = -100) -> int:
    """Items a micro-batch's mean loss is taken over, under the ``normalize`` rule (see module docstring)."""
    if normalize == "micro_batch":
        return 1
    if normalize == "samples":
        return batch_samples(batch)
    targets = batch_targets(batch)
    if targets.is_floating_point():
        raise ValueError("AccumulationScheduler(normalize='tokens'): normalize='tokens' counts integer targets != "
                         "ignore_index, got a "
                         f"{targets.dtype} target tensor; use normalize='samples'")
    return int((targets != ignore_index).sum())


def count_tokens(batch: Any, ignore_index: int = -100) -> int:
    """Non-padding tokens of a batch whose targets are an integer (B, T) tensor, else 0 (for schedules keyed by tokens).

    Positions whose target is ``ignore_index`` are padding: the loss skips them, so they are not counted.
    """
    try:
        targets = batch_targets(batch)
    except ValueError:
        return 0
    if targets.dim() < 2 or targets.is_floating_point():
        return 0
    return int((targets != ignore_index).sum())


def split_batch(batch: Any, pieces: int) -> list[Any]:
    """Split every tensor of a batch along dim 0 into ``pieces`` parts (same structure per part).

    Raises:
        ValueError: If the batch has fewer samples than ``pieces``.
    """
    if pieces == 1:
        return [batch]
    n = batch_samples(batch)
    if n < pieces:
        raise ValueError(f"cannot split a micro-batch of {n} samples into {pieces} parts")

    def part(obj: Any, i: int) -> Any:
        if isinstance(obj, torch.Tensor):
            return obj.tensor_split(pieces, dim=0)[i] if obj.dim() > 0 else obj
        if isinstance(obj, dict):
            return {k: part(v, i) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [part(v, i) for v in obj]
            return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        return obj

    return [part(batch, i) for i in range(pieces)]


def head_batch(batch: Any, n: int) -> Any:
    """The first ``n`` samples of every tensor in a batch (same structure)."""
    if isinstance(batch, torch.Tensor):
        return batch[:n] if batch.dim() > 0 else batch
    if isinstance(batch, dict):
        return {k: head_batch(v, n) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        items = [head_batch(v, n) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return batch


def scale_gradients(params: Iterable[torch.nn.Parameter], scale: float) -> None:
    """Multiply every existing gradient in place by ``scale`` (no-op for 1.0)."""
    if scale == 1.0:
        return
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch_compat.foreach_mul_(grads, scale)


def window_scale(items_in_window: float, world_size: int) -> float:
    """Factor applied to the accumulated gradients at the window's end.

    Each micro-batch backpropagated ``items_i * mean_i``; DDP then *averaged* the gradients over
    ``world_size`` processes, so multiplying by ``world_size / items_in_window`` (items summed over all
    processes) gives ``grad(sum of all per-item losses) / items_in_window``.

    Raises:
        ValueError: If the window holds no items (every target was padding).
    """
    if items_in_window <= 0:
        raise ValueError("an accumulation window held 0 items (all targets equal ignore_index?); "
                         "the normalised gradient is undefined - filter empty batches out of the data")
    return world_size / items_in_window


def optimizer_parameters(optimizers: Iterable[Any]) -> list[torch.Tensor]:
    """Every parameter the optimizers step, in their order: where the accumulated gradients live (the module's own
    parameters, or the float32 masters of ``precision=bf16-master``)."""
    return [p for opt in optimizers for group in opt.param_groups for p in group["params"]]


def partial_gradients(optimizers: list[Any]) -> list[list[list[torch.Tensor | None]]]:
    """The gradients accumulated so far, by optimizer, param group and position (as ``optimizer.state_dict()``
    orders them), copied to the CPU: the part of a mid-window checkpoint that plain Lightning does not save."""
    return [[[None if p.grad is None else p.grad.detach().cpu().clone() for p in group["params"]]
             for group in opt.param_groups] for opt in optimizers]


def restore_partial_gradients(saved: Any, optimizers: list[Any], module: torch.nn.Module) -> None:
    """Put the gradients of :func:`partial_gradients` back (or, from older checkpoints, a ``{name: grad}`` dict)."""
    if isinstance(saved, dict):
        params = dict(module.named_parameters())
        for name, grad in saved.items():
            params[name].grad = grad.to(device=params[name].device, dtype=params[name].dtype)
        return
    for opt, groups in zip(optimizers, saved):
        for group, grads in zip(opt.param_groups, groups):
            for p, grad in zip(group["params"], grads):
                p.grad = None if grad is None else grad.to(device=p.device, dtype=p.dtype)

