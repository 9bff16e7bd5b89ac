"""Where a training step's memory goes, measured the same way in every row of ``bench_real_size.py``.

Each figure is the largest seen over the run's steps, in bytes of distinct storages:

- ``weights``: the model's parameters and buffers (a tied embedding once; a bf16 base at its bf16 size);
- ``gradients``: the ``.grad`` tensors just before the optimizer step;
- ``optimizer_state``: the optimizer's state tensors after its step (a low-bit state at its packed size: the inner
  tensors of a tensor subclass);
- ``saved_activations``: what the forward pass saves for backward (``torch.autograd.graph.saved_tensors_hooks``),
  parameters excluded; with the full logits this includes them; inside a checkpointed region the checkpoint's own
  hooks take over, so only what it keeps is counted.

``tensor_bytes`` is their sum: an upper bound of the tensors alive at the step's peak (activations are freed while
gradients fill). ``bench_real_size.py`` puts the process's peak RSS beside it; the difference is the process itself
(the Python runtime and libraries, the allocator's cache, copies in flight).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

FIELDS = ("weights", "gradients", "optimizer_state", "saved_activations")


def _storages(tensor: torch.Tensor) -> Iterator[tuple[int, int]]:
    """(data pointer, bytes) of the storages behind ``tensor``: a wrapper subclass's inner tensors, else its own."""
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is not None and type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            yield from _storages(getattr(tensor, name))
        return
    storage = tensor.untyped_storage()
    yield storage.data_ptr(), storage.nbytes()


def distinct_bytes(tensors: Iterable[torch.Tensor], exclude: set[int] | None = None) -> int:
    seen: dict[int, int] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            for ptr, size in _storages(tensor):
                if ptr and (exclude is None or ptr not in exclude):
                    seen[ptr] = max(seen.get(ptr, 0), size)
    return sum(seen.values())


class Breakdown:
    """Collects the four figures; each tool's hook points call it (see ``real_size_peers.py`` and
    ``real_size_recorder.py``)."""

    def __init__(self) -> None:
        self.bytes = dict.fromkeys(FIELDS, 0)

    def _keep(self, field: str, value: int) -> None:
        self.bytes[field] = max(self.bytes[field], value)

    @contextlib.contextmanager
    def forward(self, model: torch.nn.Module) -> Iterator[None]:
        """Count what is saved for backward while the block runs (the forward pass and the loss)."""
        params = {ptr for p in model.parameters() for ptr, _ in _storages(p)}
        saved: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            for ptr, size in _storages(tensor):
                if ptr and ptr not in params:
                    saved[ptr] = max(saved.get(ptr, 0), size)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield
        self._keep("saved_activations", sum(saved.values()))

    def before_optimizer_step(self, model: torch.nn.Module) -> None:
        self._keep("weights", distinct_bytes([*model.parameters(), *model.buffers()]))
        self._keep("gradients", distinct_bytes(p.grad for p in model.parameters() if p.grad is not None))

    def after_optimizer_step(self, optimizer: Any) -> None:
        from lit_speed.compat.lightning import wrapped_optimizer

        tensors = []
        seen = set()
        while optimizer is not None and id(optimizer) not in seen:  # wrappers (Lightning's, accelerate's) included
            seen.add(id(optimizer))
            for state in getattr(optimizer, "state", {}).values():
                if isinstance(state, dict):
                    tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
            optimizer = wrapped_optimizer(optimizer)
        self._keep("optimizer_state", distinct_bytes(tensors))

    def result(self) -> dict[str, int]:
        return {**self.bytes, "tensor_bytes": sum(self.bytes.values())}
