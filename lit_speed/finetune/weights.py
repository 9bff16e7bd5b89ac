"""Read a file or folder of weights safely and load it into a model, naming the first tensor that does not fit.

The functional core of :class:`~lit_speed.finetune.init_callback.InitWeights`; usable without Lightning::

    report = load_weights(model, "logs/train/runs/x/checkpoints/last.ckpt", strict=True)

Four sources, recognised by what they hold, never by unpickling anything but tensors:

- a lit_speed / Lightning checkpoint (a ``torch.save`` dict with ``state_dict``; optimizer and loop state ignored),
- a plain ``state_dict`` (``torch.save(model.state_dict(), "model.pt")``),
- a ``.safetensors`` file,
- a Hugging Face model folder (``config.json`` with ``model.safetensors``, ``pytorch_model.bin`` or their sharded
  ``*.index.json``), e.g. what ``save_pretrained`` wrote.

``torch.load`` always runs with ``weights_only=True``: a file whose unpickling would run code is refused.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

HF_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
HF_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# prefixes a wrapper adds around the module that wrote the weights (LightningModule.model, HF's base model)
WRAPPER_PREFIXES = ("model.", "module.", "_orig_mod.")


@dataclass(frozen=True)
class LoadReport:
    """What :func:`load_weights` loaded: the source kind, the key mapping, and the counts.

    ``prefix_added`` / ``prefix_removed``: the prefix put in front of / taken off the file's keys so they name the
    model's tensors (a GPT state_dict into ``GPTModule`` gets ``model.``).
    """

    path: str
    kind: str
    loaded: int
    model_tensors: int
    strict: bool
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    prefix_added: str = ""
    prefix_removed: str = ""

    def describe(self) -> str:
        mapping = (f", keys prefixed '{self.prefix_added}'" if self.prefix_added else "") + (
            f", prefix '{self.prefix_removed}' removed" if self.prefix_removed else "")
        extra = "" if self.strict else f"; {len(self.missing)} kept as initialised, {len(self.unexpected)} unused"
        return (f"{self.path} ({self.kind}): {self.loaded}/{self.model_tensors} tensors, "
                f"{'strict' if self.strict else 'non-strict'}{mapping}{extra}")


def _torch_load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # an unsafe or damaged pickle: say which and why, never run it
        reason = " ".join(str(error).split())[:200]
        raise ValueError(f"InitWeights(path={path}): cannot be loaded safely (torch.load weights_only=True refused it: "
                         f"{reason}). Fix: a file of tensors (a state_dict, a Lightning checkpoint or .safetensors); "
                         "re-save an old pickle with torch.save(model.state_dict(), path)") from None


def _safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path), device="cpu")


def _hf_folder(folder: Path) -> dict[str, torch.Tensor]:
    for name in HF_WEIGHT_FILES:
        if (folder / name).is_file():
            return read_state_dict(folder / name)[0]
    for name in HF_INDEX_FILES:
        if (folder / name).is_file():
            shards = sorted(set(json.loads((folder / name).read_text())["weight_map"].values()))
            state: dict[str, torch.Tensor] = {}
            for shard in shards:
                state.update(read_state_dict(folder / shard)[0])
            return state
    found = ", ".join(sorted(p.name for p in folder.iterdir())[:8]) or "nothing"
    raise FileNotFoundError(f"InitWeights(path={folder}): a folder, but not a Hugging Face model folder (no "
                            f"{' / '.join(HF_WEIGHT_FILES + HF_INDEX_FILES)}; it holds {found}). Fix: path=<a "
                            "save_pretrained folder, a .ckpt, a .pt state_dict or a .safetensors file>")


def read_state_dict(path: str | Path) -> tuple[dict[str, torch.Tensor], str]:
    """The tensors stored at ``path`` and what kind of source it is (see the module docstring).

    Raises:
        FileNotFoundError: Nothing at ``path``, or a folder that is no Hugging Face model folder.
        ValueError: A file that does not load safely or holds no tensors.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        return _hf_folder(path), "hugging face folder"
    if not path.is_file():
        raise FileNotFoundError(f"InitWeights(path={path}): no such file or folder. Fix: path=<a checkpoint, "
                                "state_dict, .safetensors file or save_pretrained folder>")
    if path.suffix == ".safetensors":
        return _safetensors(path), "safetensors"
    obj = _torch_load(path)
    if isinstance(obj, Mapping) and isinstance(obj.get("state_dict"), Mapping):
        return dict(obj["state_dict"]), "lightning checkpoint"
    if isinstance(obj, Mapping) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return dict(obj), "state_dict"
    raise ValueError(f"InitWeights(path={path}): holds no tensors by name (a {type(obj).__name__}, not a state_dict "
                     "or a checkpoint with 'state_dict'). Fix: torch.save(model.state_dict(), path)")


def _best_mapping(saved: Mapping[str, Any], wanted: set[str]) -> tuple[dict[str, Any], str, str]:
    """``saved`` with keys renamed by the wrapper prefix (added or removed) that makes most of them name ``wanted``."""
    best = (dict(saved), "", "")
    best_hits = len(wanted & set(saved))
    for prefix in WRAPPER_PREFIXES:
        added = {prefix + k: v for k, v in saved.items()}
        removed = {k[len(prefix):]: v for k, v in saved.items() if k.startswith(prefix)}
        for candidate, how in ((added, (prefix, "")), (removed, ("", prefix))):
            hits = len(wanted & set(candidate))
            if hits > best_hits:
                best, best_hits = (candidate, *how), hits
    return best


def _tied_groups(model: nn.Module) -> dict[str, frozenset[str]]:
    """``{key: every key of the same tensor}`` for state_dict entries that share storage (tied weights)."""
    groups: dict[tuple[int, int], set[str]] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        if isinstance(tensor, torch.Tensor) and tensor.numel():
            groups.setdefault((tensor.untyped_storage().data_ptr(), tensor.storage_offset()), set()).add(key)
    return {key: frozenset(keys) for keys in groups.values() if len(keys) > 1 for key in keys}


def load_weights(model: nn.Module, path: str | Path, strict: bool = True) -> LoadReport:
    """Copy the tensors at ``path`` into ``model`` (weights only: no optimizer, loop or RNG state).

    Keys are matched as stored, or with a wrapper prefix added or removed (``model.``: a ``GPT`` state_dict into a
    ``GPTModule``, an HF folder into :class:`~lit_speed.models.hf_causal_lm.HFCausalLM`). A tensor tied to another
    (GPT's ``lm_head.weight``, HF's tied embeddings) counts as loaded when its partner is.

    Args:
        model: The module to fill, in place.
        path: A checkpoint, a state_dict file, a ``.safetensors`` file or a Hugging Face model folder.
        strict: Every tensor of ``model`` must be in the file and every tensor of the file must be used. Either
            way a tensor present in both with another shape is refused.

    Returns:
        A :class:`LoadReport` (counts, mapping, what was left as initialised).

    Raises:
        ValueError: Naming the first missing, unexpected or mis-shaped tensor and the fix (one line).
    """
    saved, kind = read_state_dict(path)
    mine = model.state_dict()
    tied = _tied_groups(model)
    mapped, added, removed = _best_mapping(saved, set(mine))
    where = f"InitWeights(path={path})"
    for key in [k for k in mine if k in mapped]:  # the model's order: the first one named is the first layer
        if tuple(mapped[key].shape) != tuple(mine[key].shape):
            raise ValueError(f"{where}: {key} is {tuple(mapped[key].shape)} in the file, {tuple(mine[key].shape)} in "
                             f"{type(model).__name__}: the weights were written by a model of another size. Fix: the "
                             "model.* sizes of the run that wrote them")
    missing = [k for k in mine if k not in mapped and not tied.get(k, frozenset()) & set(mapped)]
    unexpected = [k for k in mapped if k not in mine]
    if not set(mapped) & set(mine):
        raise ValueError(f"{where}: none of the file's {len(saved)} tensors name a tensor of {type(model).__name__} "
                         f"(file keys look like {next(iter(saved), '?')}, the model's like {next(iter(mine), '?')}). "
                         "Fix: weights written by this model")
    usable = {k: v for k, v in mapped.items() if k in mine}
    matched = len(mine) - len(missing)  # by name and shape (shapes were checked above), tied partners included
    if strict and (missing or unexpected):
        what = (f"{len(missing)} of {type(model).__name__}'s {len(mine)} tensors are not in the file, the first is "
                f"{missing[0]}" if missing else
                f"the file holds {len(unexpected)} tensors {type(model).__name__} lacks, the first is {unexpected[0]}")
        if 2 * matched > len(mine):  # most of the model is there (a new head, an extra buffer): a partial load helps
            raise ValueError(f"{where}: {what} (file keys look like {next(iter(saved), '?')}). Fix: weights of this "
                             f"model, or strict=false (init.strict=false) to load the {matched} tensors that match "
                             f"and keep the other {len(missing)} as initialised")
        raise ValueError(f"{where}: only {matched} of {type(model).__name__}'s {len(mine)} tensors match the file's "
                         f"{len(saved)} by name and shape: it holds another model ({what}; file keys look like "
                         f"{next(iter(saved), '?')}, the model's like {next(iter(mine), '?')}). Fix: weights written "
                         "by this model (same architecture and sizes), e.g. its own checkpoint or save_pretrained "
                         "folder")
    with torch.no_grad():
        for key, value in usable.items():
            mine[key].copy_(value.to(mine[key].dtype))
    return LoadReport(str(path), kind, len(usable) + sum(1 for k in tied if k not in usable and tied[k] & set(usable)),
                      len(mine), strict, tuple(missing), tuple(unexpected), added, removed)
