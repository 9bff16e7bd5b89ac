"""Merge adapters into their base layers and export a plain model that loads without lit_speed or peft.

::

    paths = export_merged(lightning_module, "out/")   # out/hf/ for a Hugging Face model, else out/model.pt

One format is written (``format="auto"``: a ``save_pretrained`` folder for a Hugging Face model, a ``state_dict``
file otherwise; ``"hf"`` or ``"state_dict"`` to choose). A plain LoRA ``Linear`` is merged from the layer in place
into a new float32 tensor (bitwise what ``peft``'s ``merge(safe_merge=True)`` gives on a float32 copy of the layer),
any other adapter layer by ``peft`` itself on such a copy, and the folder is written shard by shard, so the
export never holds a second copy of the model: at 0.5-1B parameters a whole merged copy costs as much memory as
the weights. The trained module is left exactly as it was (adapters, precision, activation checkpointing); its
``state_dict()`` values are used in float32 (bf16-master's masters; a bf16-held frozen base's values, exactly, and
an int8-held one's dequantized values, plus the adapters' float32 update). ``dtype="auto"`` then writes a Hugging
Face model in the dtype its folder declares (a bf16 folder: bf16, each merged value rounded once), ``"float32"``
the merge as it is.
"""
from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

import lit_speed  # the public names: trim_heap (lit_speed.memory)
from lit_speed.finetune.adapters import adapter_layers
from lit_speed.finetune.frozen_base import dequantize_frozen_base, dequantized, int8_scales


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


def hf_children(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The direct children that are Hugging Face models (they have ``save_pretrained`` and a ``config``)."""
    return [(n, m) for n, m in module.named_children() if hasattr(m, "save_pretrained") and hasattr(m, "config")]


def check_export_dir(out_dir: str | Path, owner: str = "PEFTAdapters", what: str = "merged") -> Path:
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
        raise ValueError(f"{owner}(export_dir={out_dir}): the {what} model could not be written there after training "
                         f"({reason}: {error.filename or out}). Fix: export_dir=<a folder you can write to> "
                         "(peft.export_dir=...), or export=false (peft.export=false)") from None
    return out


def _float32(tensor: torch.Tensor, scales: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """``tensor``'s float32 values: a cast, an int8-held frozen weight dequantized (``scales``: :func:`~lit_speed.
    finetune.frozen_base.int8_scales`), integers (token ids, counters) as they are."""
    if scales and id(tensor) in scales:
        return dequantized(tensor.detach(), scales[id(tensor)], torch.float32)
    return tensor.detach().float() if tensor.is_floating_point() else tensor.detach()


#: ``export_dtype``: ``auto`` writes a Hugging Face model in the dtype its folder declares (``torch_dtype`` of the
#: ``config.json`` it was loaded from: what the user started from and will serve), anything else in float32.
EXPORT_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_export_dtype(owner: str, value: str) -> str:
    """``value`` when it is one of :data:`EXPORT_DTYPES`, else a ValueError naming the setting and the fix."""
    if value not in EXPORT_DTYPES:
        raise ValueError(f"{owner}(export_dtype={value!r}): must be one of {', '.join(EXPORT_DTYPES)}. Fix: "
                         "export_dtype=auto (the dtype of the folder the model was loaded from, else float32), or "
                         "export_dtype=float32 (the merge's float32 values, unrounded)")
    return value


def folder_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype the ``config.json`` that ``model`` was loaded from declares (a local folder, or a hub id already in
    the Hugging Face cache); None when there is no such file or it names no floating dtype. The loaded model's own
    ``config.dtype`` says how it was read (float32 under lit_speed's loader), not what the folder holds."""
    source = str(getattr(getattr(model, "config", None), "name_or_path", "") or "")
    if not source:
        return None
    path = Path(source).expanduser() / "config.json"
    try:
        if not path.is_file():
            from transformers.utils import cached_file

            path = Path(cached_file(source, "config.json", local_files_only=True))  # raises OSError when absent
        fields = json.loads(path.read_text())
    except (OSError, ValueError, ImportError):  # not a folder or a cached hub id: no declared dtype
        return None
    stored = fields.get("dtype") or fields.get("torch_dtype")
    return EXPORT_DTYPES.get(str(stored))  # "auto" (a dtype chosen at load) and unknown names: None


def resolve_export_dtype(model: nn.Module, dtype: str | torch.dtype = "auto") -> torch.dtype:
    """The dtype :func:`write_hf_folder` writes ``model`` in: ``dtype`` when named, for ``"auto"`` its folder's
    declared dtype (:func:`folder_dtype`), else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    return EXPORT_DTYPES[check_export_dtype("export_merged", dtype)] or folder_dtype(model) or torch.float32


def _in_dtype(tensor: torch.Tensor, scales: dict[int, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``tensor``'s values in ``dtype``: its float32 values (:func:`_float32`) rounded once; a floating tensor goes
    straight there (a bf16-held one exported in bf16 is itself, no copy: the same values as through float32)."""
    if dtype == torch.float32 or (scales and id(tensor) in scales) or not tensor.is_floating_point():
        value = _float32(tensor, scales)
        return value.to(dtype) if value.is_floating_point() else value
    return tensor.detach().to(dtype)


def _export_items(module: nn.Module) -> Iterator[tuple[str, torch.Tensor | nn.Module]]:
    """What :func:`merged_tensors` yields, in its order, before any merge: ``(key, tensor)`` for each plain tensor
    (shared ones once: tied embeddings), then ``(name, layer)`` for each outermost adapter layer."""
    layers = [(name, layer) for name, layer in adapter_layers(module)]
    top = [(n, layer) for n, layer in layers if not any(n.startswith(other + ".") for other, _ in layers)]
    inside = tuple(f"{name}." for name, _ in top)
    seen: set[int] = set()
    for key, value in module.state_dict(keep_vars=True).items():
        shared = id(value) if value.device.type == "meta" else value.data_ptr()  # meta tensors have no storage
        if key.startswith(inside) or (value.numel() and shared in seen):
            continue
        seen.add(shared)
        yield key, value
    yield from top


def _tied_output_names(model: nn.Module) -> set[str]:
    """The output embedding's keys where the config ties it to the input embedding (``save_pretrained`` leaves them
    out; ``from_pretrained`` ties them again)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not getattr(config, "tie_word_embeddings", False) or output is None:
        return set()
    return {f"{n}.weight" for n, m in model.named_modules() if m is output}


def merged_tensors(module: nn.Module, dtype: torch.dtype = torch.float32) -> Iterator[dict[str, torch.Tensor]]:
    """``module``'s state_dict with every adapter merged in float32, in ``dtype`` (rounded once from the float32
    values), one group of tensors at a time.

    A group is one merged adapter layer (its base layer's tensors under the adapter layer's name) or one plain
    tensor; only that group's merged copy exists while it is in use. Keys are those of the merged model, the
    adapters' own tensors (``lora_A``...) are gone. Tensors that share storage (tied embeddings) come once, under
    their first name.
    """
    scales = int8_scales(module)
    for key, item in _export_items(module):
        if isinstance(item, torch.Tensor):
            yield {key: _in_dtype(item, scales, dtype)}
            continue
        name, layer = key, item
        merged = _merged_lora_linear(layer, scales)
        if merged is None:  # not a plain LoRA Linear: peft merges a float32 copy of the layer
            one = copy.deepcopy(layer)
            dequantize_frozen_base(one)  # an int8-held base layer: its float32 values before the merge
            one = one.float()
            one.merge(safe_merge=True)  # raises on non-finite merged weights
            merged = {k: _float32(v) for k, v in one.get_base_layer().state_dict().items()}
        if dtype != torch.float32:
            merged = {k: v.to(dtype) if v.is_floating_point() else v for k, v in merged.items()}
        yield {f"{name}.{k}": v for k, v in merged.items()}
        merged = one = None  # not kept while the next layer merges (the caller may have written this one)


def _merged_lora_linear(layer: nn.Module, scales: dict[int, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The base layer's float32 tensors with ``layer``'s adapter merged, for a plain LoRA ``Linear`` (one active
    adapter, no DoRA or other variant, no LoRA bias); None for any other layer.

    The same float32 operations as ``peft``'s ``merge(safe_merge=True)`` on a float32 copy of the layer (weight + (B @
    A) * scaling, transposed for ``fan_in_fan_out``), bitwise, without copying the layer first (the copies took a
    quarter of the merge's time: ``lit_speed/finetune/README.md``).
    """
    from lit_speed.compat.peft import plain_lora_linear, transpose_for

    lora = plain_lora_linear(layer)
    if lora is None:
        return None
    base = layer.get_base_layer()
    state = base.state_dict(keep_vars=True)
    if set(state) - {"weight", "bias"}:
        return None
    weight = state["weight"]
    merged = _float32(weight, scales)
    if merged.data_ptr() == weight.data_ptr():
        merged = merged.clone()  # a float32 weight: the module's own tensor, left as it is
    delta = lora.up.weight.detach().float() @ lora.down.weight.detach().float()
    merged += transpose_for(delta.mul_(lora.scaling), lora.fan_in_fan_out)  # scaled in place: no third copy
    # one sum instead of a boolean tensor of the layer's size (0.55 s of a 0.5B export): NaN or inf anywhere makes it
    # non-finite (inf - inf = NaN); finite weights overflow a float32 sum only past ~1e32 each
    if not torch.isfinite(merged.sum()):
        raise ValueError(f"NaNs detected in the merged weights. The adapter {lora.adapter} seems to be broken")
    out = {"weight": merged}
    if "bias" in state and state["bias"] is not None:
        out["bias"] = _float32(state["bias"])
    return out


#: Largest shard of a written folder. The float32 tensors of one shard are alive together until it is written: a
#: 2 GiB shard was the peak RSS of a whole 0.5B LoRA run (2.1 GiB training, 3.5 GiB while exporting: a 0.5B model's
#: float32 copy is one 2 GiB shard); at 512 MiB the export stays under the training step (the largest single tensor,
#: an embedding, still comes whole: 0.5 GiB at Qwen2.5-0.5B, 1 GiB at Llama-3.2-1B).
EXPORT_SHARD_BYTES = 512 * 2**20


def write_hf_folder(model: nn.Module, folder: str | Path, tokenizer: object | None = None,
                    max_shard_bytes: int = EXPORT_SHARD_BYTES, dtype: torch.dtype = torch.float32) -> Path:
    """Write a Hugging Face model (adapters merged in float32, then written in ``dtype``: one rounding of each merged
    value) as ``save_pretrained`` would, shard by shard.

    ``config.json`` (its dtype ``dtype``), ``generation_config.json`` when the model has one, ``model.safetensors`` (or
    numbered shards and ``model.safetensors.index.json`` above ``max_shard_bytes``) and the tokenizer. The
    output embedding is left out when the config ties it to the input embedding, as ``save_pretrained`` does.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(model.config)
    config.dtype = dtype
    config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    skipped = _tied_output_names(model)
    size = total = 0
    written: dict[str, str] = {}
    pending: dict[str, torch.Tensor] = {}
    parts: list[Path] = []

    def flush() -> None:
        nonlocal pending, size
        if pending:
            path = folder / f"model.part{len(parts):05d}.safetensors"
            save_file({k: v.contiguous() for k, v in pending.items()}, str(path), metadata={"format": "pt"})
            parts.append(path)
            written.update({k: path.name for k in pending})
            pending, size = {}, 0

    for group in merged_tensors(model, dtype):
        for key, value in group.items():
            if key in skipped:
                continue  # tied to the input embedding: from_pretrained ties it again
            # shards end where export_peak_bytes' walk ends them: float32 bytes (a bf16 folder's shards hold half)
            counted, nbytes = value.numel() * (4 if value.is_floating_point() else value.element_size()), value.nbytes
            if size and size + counted > max_shard_bytes:
                flush()
            pending[key], size, total = value, size + counted, total + nbytes
        group = value = None  # a group written out is not kept while the next one is made (export_peak_bytes)
    flush()
    if len(parts) == 1:
        parts[0].rename(folder / "model.safetensors")
    else:  # save_pretrained's names: model-00001-of-00003.safetensors and an index
        names = {p.name: f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i, p in enumerate(parts)}
        for path in parts:
            path.rename(folder / names[path.name])
        index = {"metadata": {"total_size": total}, "weight_map": {k: names[v] for k, v in sorted(written.items())}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(folder)
    return folder


def export_peak_bytes(model: nn.Module, max_shard_bytes: int = EXPORT_SHARD_BYTES) -> int:
    """The most tensor bytes :func:`write_hf_folder` holds at once, walked in its order from the shapes alone (a
    model on the meta device will do: nothing is merged): the shard being filled, and the group being made (a
    plain tensor's float32 copy; a LoRA layer's merge, two weights: the merged one and ``B @ A``, scaled in place).
    Every floating or int8-held tensor counts as a float32 copy (a float32 one is written as it is, a bf16 export
    holds half: an upper bound there), an int8-held one as two while it is dequantized (``q`` in float32, then ``q x
    scale``; its 16-bit cast, half of one, comes after the first is freed). Qwen2.5-0.5B dims:
    0.55 GB (the embedding's float32 copy, whole), where a shard plus the largest tensor said 1.08."""
    peak = pending = 0
    skipped = _tied_output_names(model)

    def nbytes(key: str, value: torch.Tensor) -> int:
        as_float = value.is_floating_point() or value.dtype == torch.int8  # int8-held: dequantized to float32
        return 0 if key in skipped else value.numel() * (4 if as_float else value.element_size())

    for key, item in _export_items(model):
        if isinstance(item, torch.Tensor):
            sizes = [nbytes(key, item)]
            making = 2 * sizes[0] if item.dtype == torch.int8 else sizes[0]  # dequantizing: q in float32, q x scale
        else:
            base = item.get_base_layer().state_dict(keep_vars=True)
            sizes = [nbytes(f"{key}.{k}", v) for k, v in base.items()]
            # B @ A, scaled in place; the finite check's sum and its scalar temporaries (a few bytes)
            making = sum(sizes) + nbytes(f"{key}.weight", base["weight"]) + 256
        peak = max(peak, pending + making)
        for size in sizes:
            if pending and pending + size > max_shard_bytes:
                pending = 0
            pending += size
    return peak


EXPORT_FORMATS = ("auto", "hf", "state_dict")


def export_merged(model: nn.Module, out_dir: str | Path, tokenizer: object | None = None,
                  format: str = "auto", dtype: str = "auto") -> dict[str, str]:
    """Write ``model`` with its adapters merged (in float32), in one format and ``dtype``.

    Args:
        model: A module with (or without) ``peft`` adapters: a LightningModule or a plain ``nn.Module``.
        out_dir: Folder to write into (created).
        tokenizer: Saved into the Hugging Face folder when given (anything with ``save_pretrained``).
        format: ``"hf"``: a ``save_pretrained`` folder per Hugging Face child (``hf/`` for a child named
            ``model``, else ``hf_<name>/``); ``"state_dict"``: ``model.pt``, a state_dict with ``model``'s keys;
            ``"auto"``: ``hf`` when ``model`` holds a Hugging Face model, else ``state_dict``.
        dtype: One of :data:`EXPORT_DTYPES`: ``"auto"`` writes a Hugging Face model in the dtype of the folder it was
            loaded from (a bf16 folder gives a bf16 folder, as ``merge_and_unload`` + ``save_pretrained`` of a model
            loaded in bf16 does, rounded once from the float32 merge), anything else in float32.

    Returns:
        ``{"hf": folder}`` or ``{"state_dict": path}``: what was written.

    Raises:
        ValueError: An unknown ``format``, or ``"hf"`` for a model without a Hugging Face child.
    """
    if format not in EXPORT_FORMATS:
        raise ValueError(f"export_merged(format={format!r}): must be one of {', '.join(EXPORT_FORMATS)}")
    children = hf_children(model)
    if format == "auto":
        format = "hf" if children else "state_dict"
    if format == "hf" and not children:
        raise ValueError(f"export_merged(format='hf'): {type(model).__name__} holds no Hugging Face model (a child "
                         "with save_pretrained and a config). Fix: peft.export_format=state_dict (or auto)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if format == "hf":
        written = {}
        for name, child in children:
            key = "hf" if name == "model" else f"hf_{name}"
            written[key] = str(write_hf_folder(child, out / key, tokenizer, dtype=resolve_export_dtype(child, dtype)))
        return written
    # contiguous clones: tied weights become two equal tensors, which torch.load(weights_only=True) reads anywhere
    cast = EXPORT_DTYPES[check_export_dtype("export_merged", dtype)] or torch.float32  # auto: no folder to ask
    state = {k: v.clone().contiguous() for group in merged_tensors(model, cast) for k, v in group.items()}
    scales = int8_scales(model)
    for key, value in model.state_dict(keep_vars=True).items():  # a tied name merged_tensors gave once
        if key not in state and not any(key.startswith(f"{n}.") for n, _ in adapter_layers(model)):
            state[key] = _in_dtype(value, scales, cast).clone().contiguous()
    torch.save(state, out / "model.pt")
    return {"state_dict": str(out / "model.pt")}


def export_after_fit(trainer: Any, module: nn.Module, out_dir: str | Path, format: str = "auto",
                     label: str = "model", dtype: str = "auto") -> tuple[dict[str, str], float] | None:
    """What the export callbacks run at ``on_fit_end``: :func:`export_merged` of ``module`` on global rank 0, with the
    module's tokenizer (else the DataModule's, the one the data was tokenized with) beside a Hugging Face model, and
    one line ``"<label> written to <out_dir> (<formats>, <dtypes>)"``.

    Returns:
        ``(written, seconds)`` on rank 0 (``written`` as :func:`export_merged` returns it), None on the other ranks.
    """
    from lightning.pytorch.utilities import rank_zero_info

    if not trainer.is_global_zero:
        return None
    tokenizer = getattr(module, "tokenizer", None) or getattr(trainer.datamodule, "tokenizer", None)
    start = time.perf_counter()
    # the free memory glibc's heaps hold (freed activations, kept by KeepFreedMemory) back to the system first, so the
    # export's float32 copies add to what the model holds and not to the training step's peak: 0.5B SFT on XA peaked
    # in the export, 3.55 GiB against a 3.26 GiB training plateau
    lit_speed.trim_heap()
    written = export_merged(module, out_dir, tokenizer, format, dtype)
    seconds = round(time.perf_counter() - start, 3)
    dtypes = sorted({str(resolve_export_dtype(child, dtype)).removeprefix("torch.") for _, child in hf_children(module)}
                    if "state_dict" not in written else {str(EXPORT_DTYPES[dtype] or torch.float32).removeprefix("torch.")})
    why = " (the dtype of the folder it was loaded from; export_dtype=float32 keeps the unrounded merge)" if \
        dtype == "auto" and dtypes != ["float32"] else ""
    rank_zero_info(f"{label} written to {out_dir} ({', '.join(sorted(written))}, {', '.join(dtypes)}){why}")
    return written, seconds
