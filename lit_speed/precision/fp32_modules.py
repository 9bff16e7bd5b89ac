"""Keep chosen submodules in float32 under autocast ("keep the critical parts in fp32").

Each matched module runs with autocast disabled and its floating inputs cast to float32, so its output is
float32 (LayerNorm statistics, a softmax, a loss module). Under ``bf16-true`` its weights stay float32 and its
output is cast back to bf16 so the next layer gets the dtype it expects.
"""
from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor in it (through tuples, lists and dicts) cast to ``dtype``."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, (tuple, list)):
        return type(value)(cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: cast_floating(v, dtype) for k, v in value.items()}
    return value


def match_modules(model: nn.Module, specs: Sequence[str | type]) -> dict[str, nn.Module]:
    """Modules matching any spec: a class, a class name (``"LayerNorm"``, base classes count) or a name.

    Raises:
        ValueError: a spec matches no module; the message lists the class names that are present.
    """
    found: dict[str, nn.Module] = {}
    for spec in specs:
        hits = {}
        for name, module in model.named_modules():
            classes = type(module).__mro__
            if (isinstance(spec, type) and isinstance(module, spec)) or (
                    isinstance(spec, str) and (name == spec or any(c.__name__ == spec for c in classes))):
                hits[name] = module
        if not hits:
            present = sorted({type(m).__name__ for m in model.modules()})
            raise ValueError(f"GuardedPrecision(fp32_modules={list(specs)!r}): fp32_modules entry {spec!r} "
                             f"matches no module of {type(model).__name__}. "
                             f"Use a class name ({', '.join(present)}) or a module name from named_modules().")
        found.update(hits)
    # a matched module inside another matched one is covered by its parent's hooks
    return {n: m for n, m in found.items() if not any(n.startswith(p + ".") for p in found if p)}


class Float32Islands:
    """Installs and removes the hooks that run matched modules in float32.

    Args:
        device_type: The autocast device (``"cpu"`` or ``"cuda"``).
        output_dtype: Cast outputs to this dtype (``bf16-true``), or ``None`` to leave them float32.
    """

    def __init__(self, device_type: str, output_dtype: torch.dtype | None = None) -> None:
        self.device_type = device_type
        self.output_dtype = output_dtype
        self._handles: list[RemovableHandle] = []
        self._contexts: list[torch.autocast] = []

    def install(self, modules: dict[str, nn.Module]) -> None:
        self.remove()
        for module in modules.values():
            if self.output_dtype is not None:
                module.to(torch.float32)
            self._handles.append(module.register_forward_pre_hook(self._enter, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._exit, always_call=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        context = torch.autocast(self.device_type, enabled=False)
        context.__enter__()
        self._contexts.append(context)
        return cast_floating(args, torch.float32), cast_floating(kwargs, torch.float32)

    def _exit(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self._contexts:  # LIFO: nested float32 modules exit in reverse order of entry
            self._contexts.pop().__exit__(None, None, None)
        return output if self.output_dtype is None else cast_floating(output, self.output_dtype)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    """``torch``'s default dtype is ``dtype`` inside the ``with`` block, and what it was before after it."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
