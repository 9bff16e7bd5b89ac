"""Activation checkpointing (and activation offload) for chosen submodule types of any LightningModule.

The functional core, :func:`checkpoint_modules` / :func:`restore_modules`, works on any ``nn.Module``; the
:class:`ActivationCheckpointing` callback only applies it at ``setup`` and undoes it at ``teardown``. The module
name ``"decoder-layers"`` finds the model's decoder layers without naming their class
(:func:`lit_speed.memory.decoder_layers.decoder_layer_types`: a Hugging Face model's ``LlamaDecoderLayer``,
``Qwen2DecoderLayer``, ``GPT2Block``..., the bundled GPT's ``Block``, under peft's wrappers too).

Why this wraps the layers itself rather than calling Hugging Face's ``activation_checkpointing_enable()``
(``gradient_checkpointing_enable`` before transformers 5): both run ``torch.utils.checkpoint`` non-reentrant on the
same layers, but Hugging Face's checkpoints only while the layer is in ``training`` mode (a model from
``from_pretrained`` is in eval mode and Lightning 2.6 keeps modes: its flag would silently do nothing), leaves a
forward hook on the input embeddings (``enable_input_require_grads``, which only reentrant checkpointing needs under
LoRA) and a flag on the model after the run, and exists only for Hugging Face models. This wrapper is the same
for every model, exact (the same ops in the same order, dropout masks replayed from the saved RNG state), leaves
``state_dict`` keys unchanged (resume and ZeRO checkpoints move freely between runs with and without it) and is
undone at teardown.
"""
from __future__ import annotations

import importlib
from typing import Any, Iterable, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.utils.checkpoint import checkpoint
from typing_extensions import override

from lit_speed.memory.decoder_layers import DECODER_LAYERS, decoder_layer_types

_ATTR = "_lit_speed_checkpointed"


class _CheckpointedForward:
    """Replaces ``module.forward`` on the instance: no wrapper module, so ``state_dict`` keys do not change.

    It keeps a reference to its module (not a bound method), so ``copy.deepcopy`` of the model copies it
    pointing at the copied module.
    """

    def __init__(self, module: nn.Module, offload: bool) -> None:
        self.module = module
        self.offload = offload

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = type(self.module).forward.__get__(self.module)
        if not torch.is_grad_enabled():  # evaluation: nothing is saved, so nothing to recompute
            return forward(*args, **kwargs)
        if self.offload:
            # The non-reentrant checkpoint saves the region's inputs with save_for_backward *outside* its own
            # hooks, so save_on_cpu moves exactly those boundary activations to host memory.
            with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
                return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def resolve_module_types(specs: Iterable[str | type], root: nn.Module) -> list[type]:
    """Turn class names (``"Block"``), dotted import paths, classes or ``"decoder-layers"`` (the model's decoder
    layers, whatever their class: :func:`~lit_speed.memory.decoder_layers.decoder_layer_types`) into the submodule
    types of ``root``.

    Raises:
        ValueError: A name matches no submodule type of ``root`` (the message lists the types it has), or
            ``"decoder-layers"`` finds no layer stack.
    """
    present = {type(m) for m in root.modules()}
    by_name: dict[str, list[type]] = {}
    for cls in present:
        by_name.setdefault(cls.__name__, []).append(cls)
    resolved: list[type] = []
    for spec in specs:
        if isinstance(spec, type):
            resolved.append(spec)
        elif spec == DECODER_LAYERS:
            resolved += decoder_layer_types(root)
        elif "." in spec:
            module_name, _, cls_name = spec.rpartition(".")
            try:
                resolved.append(getattr(importlib.import_module(module_name), cls_name))
            except (ImportError, AttributeError) as error:
                raise ValueError(f"modules: cannot import {spec!r} ({error}); give a class name "
                                 f"such as 'Block' or a full import path such as 'lit_speed.models.gpt.Block'") from None
        elif spec in by_name:
            resolved += by_name[spec]
        else:
            names = ", ".join(sorted(by_name))
            raise ValueError(f"modules: no submodule of type {spec!r} in {type(root).__name__}. "
                             f"Types present: {names}. Pick the repeated block, e.g. modules=[Block], or "
                             f"modules=[{DECODER_LAYERS}] to find it")
    return resolved


def checkpoint_modules(root: nn.Module, types: Sequence[str | type], offload: bool = False) -> list[str]:
    """Wrap every submodule of ``root`` whose type is in ``types`` with non-reentrant checkpointing.

    Args:
        root: The model; edited in place (instance attributes only, parameters untouched).
        types: Class names, dotted import paths or classes of the submodules to checkpoint.
        offload: Also move the checkpointed regions' saved inputs to host memory (``save_on_cpu``,
            pinned when CUDA is available). On a CPU-only machine host memory *is* device memory, so this
            changes nothing there but costs a little time.

    Returns:
        The qualified names of the wrapped submodules.

    Raises:
        ValueError: ``types`` is empty, names an unknown type, or matches no submodule.
    """
    if not types:
        raise ValueError("checkpoint_modules(types=[]): types is empty: name the submodule types to checkpoint, "
                         "e.g. [Block]")
    classes = tuple(resolve_module_types(types, root))
    wrapped = []
    for name, module in root.named_modules():
        if isinstance(module, classes) and not getattr(module, _ATTR, False) and module is not root:
            module.forward = _CheckpointedForward(module, offload)
            setattr(module, _ATTR, True)
            wrapped.append(name)
    if not wrapped and not any(getattr(m, _ATTR, False) for m in root.modules()):
        raise ValueError(f"checkpoint_modules(types={list(map(str, types))}): matched no submodule of "
                         f"{type(root).__name__} (the root module itself is never wrapped)")
    return wrapped


def restore_modules(root: nn.Module) -> int:
    """Undo :func:`checkpoint_modules`; returns how many submodules were restored."""
    restored = 0
    for module in root.modules():
        if getattr(module, _ATTR, False):
            del module.forward
            delattr(module, _ATTR)
            restored += 1
    return restored


def activation_checkpointing_on(root: nn.Module) -> bool:
    """Whether any submodule of ``root`` recomputes its activations in backward: wrapped by
    :func:`checkpoint_modules`, by torch's ``checkpoint_wrapper``, or a Hugging Face model with gradient
    checkpointing enabled (``gradient_checkpointing_enable()``)."""
    return any(getattr(m, _ATTR, False) or type(m).__name__ == "CheckpointWrapper" or _hf_checkpointing(m)
               for m in root.modules())


def _hf_checkpointing(module: nn.Module) -> bool:
    """A Hugging Face model's own flag: ``is_activation_checkpointing`` (transformers 5), else the name it had before,
    which transformers 5 keeps as an alias that prints a FutureWarning on every read."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(module), name):
            return getattr(module, name) is True
    return False


class ActivationCheckpointing(Callback):
    """Recompute the activations of chosen submodules in backward instead of keeping them.

    Saves the memory of everything computed inside each wrapped block except its input, at the cost of one
    extra forward of those blocks. Gradients are unchanged (same ops, same order). ``state_dict`` keys are
    unchanged, so checkpoints move freely between runs with and without it.

    Args:
        modules: Submodule types to wrap: class names (``"Block"``), dotted paths, classes, or ``"decoder-layers"``
            (the default): the model's decoder layers, found at setup (a Hugging Face model's, the bundled GPT's).
        offload: Also keep each wrapped block's input in (pinned) host memory instead of on the GPU.

    Raises:
        ValueError: ``modules`` is empty or not a list of names/classes; at setup, a name matches nothing.

    Example::

        trainer = Trainer(callbacks=[ActivationCheckpointing()])                  # the decoder layers, any model
        trainer = Trainer(callbacks=[ActivationCheckpointing(modules=["Block"])])  # a class by name
    """

    def __init__(self, modules: Sequence[str | type] = (DECODER_LAYERS,), offload: bool = False) -> None:
        if isinstance(modules, (str, type)):
            modules = [modules]
        modules = list(modules)
        if not modules or not all(isinstance(m, (str, type)) for m in modules):
            raise ValueError(f"ActivationCheckpointing(modules={modules!r}): modules must be a non-empty list of class "
                             f"names, import paths or "
                             f"classes, got {modules!r}; e.g. modules=[Block]")
        self.modules = modules
        self.offload = bool(offload)
        self.wrapped: list[str] = []

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        try:
            self.wrapped = checkpoint_modules(pl_module, self.modules, self.offload)
        except ValueError as error:  # named after this class and argument: the runner prefixes the config path
            shown = [m if isinstance(m, str) else m.__name__ for m in self.modules]
            raise ValueError(f"ActivationCheckpointing(modules={shown}): {error}") from None
        classes = sorted({type(pl_module.get_submodule(name)).__name__ for name in self.wrapped})
        rank_zero_info(f"ActivationCheckpointing: {len(self.wrapped)} submodules wrapped ({', '.join(classes)})"
                       + (" (inputs offloaded to host)" if self.offload else ""))

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        restore_modules(pl_module)

    def describe(self) -> dict[str, str]:
        names = ", ".join(m if isinstance(m, str) else m.__name__ for m in self.modules)
        where = "; block inputs offloaded to host" if self.offload else ""
        done = f"{len(self.wrapped)} wrapped" if self.wrapped else "wrapped at setup"
        return {"activation checkpointing": f"{names} ({done}){where}"}

    def final_summary(self) -> dict[str, Any]:
        return {"wrapped_modules": len(self.wrapped), "offload": self.offload}
