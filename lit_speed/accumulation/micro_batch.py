"""Pick the largest micro-batch that fits (out-of-memory errors are recognised by :mod:`lit_speed.oom`).

CPU allocations rarely fail cleanly, so on CPU the micro-batch is chosen against a *memory budget*: the
bytes of tensors autograd saves for backward, measured on the real module at two micro-batch sizes and
extrapolated linearly (activations grow linearly with the micro-batch; weights, gradients and optimizer state do not).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from lit_speed.accumulation.window import batch_samples, head_batch
from lit_speed.compat.lightning import muted_log


def saved_activation_bytes(step: Callable[[], torch.Tensor]) -> int:
    """Bytes of the tensors autograd saves for backward while ``step()`` runs a forward pass.

    Counts each storage once (views of one tensor share it). ``step`` returns the loss; no backward runs.
    """
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, torch.nn.Parameter):
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values())


def pick_micro_batch(bytes_per_sample: float, fixed_bytes: float, budget_bytes: float,
                     candidates: list[int]) -> int:
    """Largest candidate micro-batch ``b`` with ``fixed_bytes + b * bytes_per_sample <= budget_bytes``.

    Raises:
        ValueError: If not even the smallest candidate fits, naming the budget needed.
    """
    fitting = [b for b in sorted(candidates) if fixed_bytes + b * bytes_per_sample <= budget_bytes]
    if not fitting:
        smallest = min(candidates)
        need = (fixed_bytes + smallest * bytes_per_sample) / 2**20
        raise ValueError(f"AccumulationScheduler(memory_budget_mb={budget_bytes / 2**20:.1f}): memory_budget_mb = "
                         f"{budget_bytes / 2**20:.1f} is too small: micro-batch "
                         f"{smallest} needs {need:.1f} MiB of activations; raise the budget or shrink the model")
    return fitting[-1]


def divisor_candidates(per_process_batch: int) -> list[int]:
    """Micro-batches that divide a process's share of the effective batch (so accumulation is whole)."""
    return [b for b in range(1, per_process_batch + 1) if per_process_batch % b == 0]


def measure_activation_model(loss_fn: Callable[[Any], torch.Tensor], batch: Any,
                             slicer: Callable[[Any, int], Any]) -> tuple[float, float]:
    """Fit ``bytes(b) = fixed + b * per_sample`` from the saved activations of micro-batches 1 and 2.

    Args:
        loss_fn: Runs the module's forward on a batch and returns the loss.
        batch: A real training batch with at least 2 samples.
        slicer: ``(batch, n) -> first n samples of batch``.

    Returns:
        ``(per_sample_bytes, fixed_bytes)``.
    """
    # copies, so a saved input counts its own bytes and not the storage of the whole batch it was sliced from
    one = saved_activation_bytes(lambda: loss_fn(_copy(slicer(batch, 1))))
    two = saved_activation_bytes(lambda: loss_fn(_copy(slicer(batch, 2))))
    per_sample = max(two - one, 1)
    return float(per_sample), float(max(one - per_sample, 0))


def probe_micro_batch(module: torch.nn.Module, batch: Any, effective_batch: Mapping[int, int], world_size: int,
                      budget_mb: float) -> tuple[int, float]:
    """Largest micro-batch whose saved activations fit ``budget_mb``, dividing every scheduled effective batch.

    Runs the LightningModule's own ``training_step`` (forward only, logging muted, torchmetrics reset
    afterwards) on 1 and 2 samples of a real batch.

    Returns:
        ``(micro_batch, activation_bytes_per_sample)``.

    Raises:
        ValueError: If the batch has fewer than 2 samples or nothing fits the budget.
    """
    if batch_samples(batch) < 2:
        raise ValueError("AccumulationScheduler(micro_batch='auto'): micro_batch='auto' probes micro-batches of 1 "
                         "and 2 samples; "
                         "the datamodule's batch_size must be >= 2")
    was_training = module.training
    module.train()
    try:
        def loss_fn(b: Any) -> torch.Tensor:
            out = module.training_step(b, 0)
            return out["loss"] if isinstance(out, Mapping) else out

        with muted_log(module):  # the probe runs outside Lightning's loop, where self.log raises
            per_sample, fixed = measure_activation_model(loss_fn, batch, head_batch)
    finally:
        module.train(was_training)
        for metric in module.modules():  # metrics the probe's forward updated
            if type(metric).__module__.startswith("torchmetrics") and hasattr(metric, "reset"):
                metric.reset()
    per_process = min(effective_batch.values()) // world_size
    candidates = [b for b in divisor_candidates(per_process)
                  if all(v % (b * world_size) == 0 for v in effective_batch.values())]
    return pick_micro_batch(per_sample, fixed, budget_mb * 2**20, candidates), per_sample


def _copy(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, dict):
        return {k: _copy(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        items = [_copy(v) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return batch
