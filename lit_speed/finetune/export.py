"""Merge adapters into their base layers and export a plain model that loads without lit_speed or peft.

::

    paths = export_merged(lightning_module, "out/")   # out/model.pt (+ out/hf/ for a Hugging Face model)

The merge is ``peft``'s (``merge(safe_merge=True)`` of each adapter layer, then the layer is replaced by its base
layer); it runs on a float32 copy of the module's children, so the trained module is left as it is (adapters,
precision, activation checkpointing) and ``state_dict()``'s float32 values are used (bf16-master's masters).
"""
from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
from torch import nn

from lit_speed.finetune.adapters import adapter_layers


def merge_adapters(model: nn.Module) -> int:
    """Merge every ``peft`` adapter layer of ``model`` into its base layer and put the base layer back, in place.

    Returns:
        How many adapter layers were merged (0 for a model without adapters).

    Raises:
        ValueError: A merge that produced non-finite weights (peft's ``safe_merge``).
    """
    layers = adapter_layers(model)
    modules = dict(model.named_modules())
    for name, layer in layers:
        if any(name.startswith(other + ".") for other, _ in layers):
            continue  # nested inside another adapter layer: merged with it
        layer.merge(safe_merge=True)
        parent_name, _, child = name.rpartition(".")
        setattr(modules[parent_name] if parent_name else model, child, layer.get_base_layer())
    return len(layers)


def merged_copy(model: nn.Module) -> nn.Module:
    """A float32 copy of ``model``'s children holding ``model.state_dict()``'s values, adapters merged.

    Only the children are copied: a LightningModule's trainer and the hooks a precision plugin put on the module
    itself stay behind. The copy's ``state_dict`` keys are ``model``'s, without the adapters'.
    """
    values = {k: v.detach().float() if v.is_floating_point() else v.detach()
              for k, v in model.state_dict().items()}
    root = nn.Module()
    for name, child in model.named_children():
        setattr(root, name, copy.deepcopy(child))
    root.float()
    missing, unexpected = root.load_state_dict({k: v for k, v in values.items()}, strict=False)
    own = [k for k in missing if "." not in k]  # parameters of the module itself (not of a child) are not copied
    if unexpected or [k for k in missing if k not in own]:
        raise ValueError(f"merged_copy: the copy of {type(model).__name__} does not take its own state_dict "
                         f"(missing {list(missing)[:3]}, unexpected {list(unexpected)[:3]})")
    merge_adapters(root)
    return root


def hf_children(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The direct children that are Hugging Face models (they have ``save_pretrained`` and a ``config``)."""
    return [(n, m) for n, m in module.named_children() if hasattr(m, "save_pretrained") and hasattr(m, "config")]


def check_export_dir(out_dir: str | Path, owner: str = "PEFTAdapters") -> Path:
    """Create ``out_dir`` (and its parents) and prove it writable with a probe file, before any training.

    Raises:
        ValueError: The folder cannot be created or written, naming why and the fix.
    """
    out = Path(out_dir).expanduser()
    probe = out / f".write_probe_{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise ValueError(f"{owner}(export_dir={out_dir}): the merged model could not be written there after training "
                         f"({reason}: {error.filename or out}). Fix: export_dir=<a folder you can write to> "
                         "(peft.export_dir=...), or export=false (peft.export=false)") from None
    return out


def export_merged(model: nn.Module, out_dir: str | Path, tokenizer: object | None = None) -> dict[str, str]:
    """Write ``model`` with its adapters merged: ``model.pt`` (a state_dict with ``model``'s keys) and, for each
    Hugging Face child, a ``save_pretrained`` folder (``hf/`` for a child named ``model``, else ``hf_<name>/``).

    Args:
        model: A module with (or without) ``peft`` adapters: a LightningModule or a plain ``nn.Module``.
        out_dir: Folder to write into (created).
        tokenizer: Saved into the Hugging Face folder when given (anything with ``save_pretrained``).

    Returns:
        ``{"state_dict": path, "hf": folder, ...}``: what was written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    merged = merged_copy(model)
    written = {"state_dict": str(out / "model.pt")}
    # contiguous clones: tied weights become two equal tensors, which torch.load(weights_only=True) reads anywhere
    torch.save({k: v.clone().contiguous() for k, v in merged.state_dict().items()}, out / "model.pt")
    for name, child in hf_children(merged):
        folder = out / ("hf" if name == "model" else f"hf_{name}")
        child.save_pretrained(folder)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(folder)
        written["hf" if name == "model" else f"hf_{name}"] = str(folder)
    return written
