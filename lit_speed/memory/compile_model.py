"""``torch.compile`` for a LightningModule without ``_orig_mod`` keys in its checkpoints.

``torch.compile(model)`` returns an ``OptimizedModule`` wrapper whose ``state_dict`` keys gain an
``_orig_mod.`` prefix, so checkpoints of compiled and uncompiled runs do not load into each other
(Lightning #17415, #20233). ``nn.Module.compile()`` compiles a module's ``__call__`` *in place* instead:
parameters, names and ``state_dict`` stay exactly as they were. :func:`compile_modules` applies it to the
repeated blocks (regional compilation: one block is compiled and reused, so cold start stays short) or to
the whole model; :class:`CompileModel` does that at ``setup``.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from typing_extensions import override

from lit_speed.compat import torch as torch_compat
from lit_speed.memory.activation_checkpointing import resolve_module_types

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def repeated_block_types(root: nn.Module) -> list[type]:
    """Composite types (with submodules of their own) repeated inside a ``ModuleList``/``Sequential``: the blocks.

    Leaf layers (``Linear``, ``GELU``) repeat too, but wrapping or compiling them one by one gains nothing.
    """
    counts: Counter[type] = Counter()
    for container in root.modules():
        if isinstance(container, (nn.ModuleList, nn.Sequential)):
            counts.update(type(child) for child in container.children() if next(child.children(), None) is not None)
    return [cls for cls, n in counts.items() if n > 1]


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` was compiled in place (``nn.Module.compile()``)."""
    return torch_compat.is_compiled(module)


def compile_modules(root: nn.Module, regional: bool = True, modules: Sequence[str | type] | None = None,
                    **compile_kwargs: Any) -> list[str]:
    """Compile ``root`` in place (``regional=False``) or each submodule of the given/repeated types.

    Returns:
        Qualified names of the compiled modules (``""`` for the root).

    Raises:
        ValueError: Regional compilation finds no repeated block and ``modules`` is not given.
    """
    if not regional:
        root.compile(**compile_kwargs)
        return [""]
    classes = tuple(resolve_module_types(modules, root) if modules else repeated_block_types(root))
    if not classes:
        raise ValueError(f"compile_modules(regional=True): {type(root).__name__} has no repeated block type; "
                         f"name one with modules=[...] or set regional=False")
    names = []
    for name, module in root.named_modules():
        if module is not root and isinstance(module, classes):
            module.compile(**compile_kwargs)
            names.append(name)
    return names


def uncompile_modules(root: nn.Module) -> int:
    """Return every in-place-compiled module of ``root`` to eager mode; returns how many there were."""
    compiled = [m for m in root.modules() if is_compiled(m)]
    for module in compiled:
        torch_compat.uncompile(module)
    return len(compiled)


class CompileModel(Callback):
    """Compile the LightningModule's repeated blocks (or the whole model) with ``torch.compile`` at setup.

    Checkpoints keep their eager ``state_dict`` keys, so a compiled run's checkpoint loads into an
    uncompiled model and the other way round.

    Args:
        mode: ``torch.compile`` mode, one of ``default``, ``reduce-overhead``, ``max-autotune``,
            ``max-autotune-no-cudagraphs``.
        regional: Compile each repeated block (short cold start, one graph reused) instead of the whole model.
        modules: Block types to compile when ``regional``; ``None`` finds the repeated ones.
        backend: ``torch.compile`` backend (``inductor``; ``eager`` only traces, useful to test the wiring).
        dynamic: ``torch.compile`` dynamic-shape setting (``None`` = decide automatically).
        fullgraph: Fail instead of falling back to eager at graph breaks.

    Raises:
        ValueError: ``mode`` is not one of the modes above.

    Example::

        trainer = Trainer(callbacks=[CompileModel(regional=True)])
    """

    def __init__(self, mode: str = "default", regional: bool = True, modules: Sequence[str] | None = None,
                 backend: str = "inductor", dynamic: bool | None = None, fullgraph: bool = False) -> None:
        if mode not in MODES:
            raise ValueError(f"CompileModel(mode={mode!r}): mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.regional = bool(regional)
        self.modules = list(modules) if modules else None
        self.backend = backend
        self.dynamic = dynamic
        self.fullgraph = bool(fullgraph)
        self.compiled: list[str] = []

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        kwargs: dict[str, Any] = {"backend": self.backend, "dynamic": self.dynamic, "fullgraph": self.fullgraph}
        if self.backend == "inductor":
            kwargs["mode"] = self.mode
        self.compiled = compile_modules(pl_module, self.regional, self.modules, **kwargs)
        rank_zero_info(f"CompileModel: {len(self.compiled)} module(s) compiled lazily "
                       f"(first step pays the compile time)")

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        uncompile_modules(pl_module)

    def describe(self) -> dict[str, str]:
        blocks = f"{len(self.compiled)} blocks" if self.compiled else "repeated blocks, at setup"
        what = f"{blocks} (regional)" if self.regional else "whole model"
        return {"compile": f"torch.compile {self.backend}/{self.mode}: {what}"}

    def final_summary(self) -> dict[str, Any]:
        return {"compiled_modules": len(self.compiled), "mode": self.mode, "regional": self.regional,
                "backend": self.backend, "torch": torch.__version__}
