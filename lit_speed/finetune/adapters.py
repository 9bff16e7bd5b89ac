"""Add parameter-efficient adapters to any ``nn.Module`` with Hugging Face ``peft``, and freeze the rest.

The functional core of :class:`~lit_speed.finetune.peft_callback.PEFTAdapters`; usable without Lightning::

    names = add_adapters(model, "lora", target_modules=["all-linear"], r=8, alpha=16)

``peft`` does the math (``inject_adapter_in_model`` puts its LoRA/LoHa/LoKr layers in place, so the module keeps
its class, its ``forward`` and every key of its ``state_dict``, plus the adapters'). What lit_speed adds: targets
chosen by module names *or* classes, refused with the names that exist when they match nothing, and an optional
list of whole modules left trainable (a new head).
"""
from __future__ import annotations

import difflib
import hashlib
import importlib
from typing import Any, Iterable, Sequence

import torch
from torch import nn

# method -> (peft config class, its name for alpha, its name for dropout)
METHODS = {"lora": ("LoraConfig", "lora_alpha", "lora_dropout"),
           "loha": ("LoHaConfig", "alpha", "module_dropout"),
           "lokr": ("LoKrConfig", "alpha", "module_dropout"),
           "freeze": (None, None, None)}  # no adapter: only ``trainable_modules`` train (e.g. the head)
ALL_LINEAR = "all-linear"    # every Linear (and HF Conv1D) layer except the output head
LAST_LINEAR = "last-linear"  # the last Linear layer in module order (the head of most models)


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"  # HF GPT-2's Linear


def _output_head(model: nn.Module) -> set[str]:
    """Names of the output projection(s): HF's output embeddings, or a Linear tied to an Embedding."""
    heads = set()
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    hf_heads = {id(m.get_output_embeddings()) for m in model.modules()
                if hasattr(m, "get_output_embeddings") and callable(m.get_output_embeddings)
                and isinstance(m.get_output_embeddings(), nn.Module)}
    for name, module in model.named_modules():
        if _is_linear(module) and (id(module) in hf_heads or id(getattr(module, "weight", None)) in embedding_weights):
            heads.add(name)
    return heads


def _class_matches(spec: str, module: nn.Module) -> bool:
    if "." in spec:
        module_name, _, cls_name = spec.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError):
            return False
        return isinstance(module, cls)
    return type(module).__name__ == spec


def module_names_matching(model: nn.Module, specs: Iterable[str | type], owner: str = "PEFTAdapters",
                          argument: str = "target_modules") -> list[str]:
    """Qualified names of the submodules of ``model`` that ``specs`` select, in module order.

    A spec is ``all-linear``, ``last-linear``, a module name (the full name or its last parts: ``qkv`` matches
    ``model.blocks.0.attn.qkv``), a class name (``Linear``, ``LlamaAttention``), an import path or a class.

    Raises:
        ValueError: A spec that matches nothing, listing the module names and classes that exist.
    """
    named = [(n, m) for n, m in model.named_modules() if n]
    chosen: dict[str, None] = {}
    for spec in specs:
        if spec == ALL_LINEAR:
            heads = _output_head(model)
            found = [n for n, m in named if _is_linear(m) and n not in heads]
        elif spec == LAST_LINEAR:
            found = [n for n, m in named if _is_linear(m)][-1:]
        elif isinstance(spec, type):
            found = [n for n, m in named if isinstance(m, spec)]
        else:
            found = [n for n, _ in named if n == spec or n.endswith("." + spec)]
            found = found or [n for n, m in named if _class_matches(spec, m)]
        if not found:
            leaves = sorted({n.rsplit(".", 1)[-1] for n, _ in named if not n.rsplit(".", 1)[-1].isdigit()})
            classes = sorted({type(m).__name__ for _, m in named})
            raise ValueError(f"{owner}({argument}={[str(s) for s in specs]}): {str(spec)!r} matches no module name or "
                             f"class of {type(model).__name__}. Module names: {', '.join(leaves)}. Classes: "
                             f"{', '.join(classes)}. Fix: {argument}=[<names or classes from these>], or "
                             f"[{ALL_LINEAR}]")
        chosen.update(dict.fromkeys(found))
    order = {n: i for i, (n, _) in enumerate(named)}
    return sorted(chosen, key=order.__getitem__)


def peft_config(method: str, target_names: Sequence[str], r: int, alpha: float, dropout: float,
                options: dict[str, Any] | None = None) -> Any:
    """The ``peft`` config object of ``method`` for exactly the modules named ``target_names``."""
    import dataclasses

    import peft

    class_name, alpha_key, dropout_key = METHODS[method]
    config_class = getattr(peft, class_name)
    options = dict(options or {})
    set_here = {"r", alpha_key, dropout_key, "target_modules"}
    accepted = sorted(f.name for f in dataclasses.fields(config_class) if f.init and f.name not in set_here)
    own = {alpha_key: "alpha", dropout_key: "dropout", "r": "r", "target_modules": "target_modules"}
    for key, value in options.items():
        if key in own:
            raise ValueError(f"PEFTAdapters(options={options}): {key!r} is PEFTAdapters' own argument {own[key]!r} "
                             f"(it sets {class_name}'s {key}). Fix: peft.{own[key]}={value} instead of "
                             f"peft.options.{key}")
    unknown = [k for k in options if k not in accepted]
    if unknown:  # peft's TypeError would name neither the option nor what it takes
        near = difflib.get_close_matches(unknown[0], accepted, n=1)
        hint = f" Did you mean {near[0]}?" if near else ""
        raise ValueError(f"PEFTAdapters(options={options}): {unknown[0]!r} is not an argument of peft's "
                         f"{class_name}.{hint} It takes: {', '.join(accepted)}. Fix: drop it "
                         f"(~peft.options.{unknown[0]}), or one of those")
    kwargs = {"r": r, alpha_key: alpha, dropout_key: dropout, **options}
    try:
        # full names: peft matches a list by name or dotted suffix, so a full name selects exactly that module
        return config_class(target_modules=list(target_names), **kwargs)
    except (ValueError, TypeError) as error:  # a known option with a value peft refuses
        raise ValueError(f"PEFTAdapters(options={options}): peft's {class_name} refused it "
                         f"({' '.join(str(error).split())[:300]}). Fix: the values its documentation allows, or "
                         "drop the option") from None


def add_adapters(model: nn.Module, method: str = "lora", target_modules: Sequence[str | type] = (ALL_LINEAR,),
                 r: int = 8, alpha: float = 16.0, dropout: float = 0.0, trainable_modules: Sequence[str | type] = (),
                 options: dict[str, Any] | None = None) -> list[str]:
    """Put ``method``'s adapters into ``model`` in place and freeze every other parameter.

    Args:
        model: Any module (a LightningModule, an HF model, a plain ``nn.Module``).
        method: ``lora``, ``loha``, ``lokr`` (``peft``'s layers) or ``freeze`` (no adapter).
        target_modules: What gets adapters (see :func:`module_names_matching`).
        r: Adapter rank.
        alpha: Scaling numerator (LoRA's update is scaled by ``alpha / r``).
        dropout: Dropout on the adapter path.
        trainable_modules: Whole modules left trainable besides the adapters (e.g. ``[last-linear]``, a new head).
        options: Further arguments of the ``peft`` config class (e.g. ``{use_rslora: true}``).

    Returns:
        The qualified names of the modules that got adapters.

    Raises:
        ValueError: An unknown method, a non-positive rank, targets that match nothing, or ``peft`` refusing a layer.
    """
    if method not in METHODS:
        raise ValueError(f"PEFTAdapters(method={method!r}): unknown method. Fix: method=<one of {', '.join(METHODS)}>")
    # one name, as peft takes it (target_modules="all-linear", or peft.target_modules=all-linear typed on a command line)
    target_modules = [target_modules] if isinstance(target_modules, str) else target_modules
    trainable_modules = [trainable_modules] if isinstance(trainable_modules, str) else trainable_modules
    if method != "freeze" and (isinstance(r, bool) or not isinstance(r, int) or r < 1):
        raise ValueError(f"PEFTAdapters(r={r!r}): the adapter rank must be an int >= 1. Fix: r=8 (4-64 is usual)")
    targets = module_names_matching(model, target_modules) if method != "freeze" and target_modules else []
    if method != "freeze" and not targets:
        raise ValueError(f"PEFTAdapters(target_modules={list(target_modules)}): method={method} needs target modules. "
                         f"Fix: target_modules=[{ALL_LINEAR}], or method=freeze with trainable_modules")
    keep = module_names_matching(model, trainable_modules, argument="trainable_modules") if trainable_modules else []
    if method == "freeze":
        if not keep:
            raise ValueError("PEFTAdapters(method=freeze): nothing would train. Fix: trainable_modules=[last-linear] "
                             "(the head) or other module names")
        model.requires_grad_(False)
    else:
        import peft

        from lit_speed.compat.peft import scale_lora_down

        config = peft_config(method, targets, r, alpha, dropout, options)  # an option peft refuses names itself
        try:
            peft.inject_adapter_in_model(config, model)
        except (ValueError, TypeError) as error:  # e.g. a container class: peft adapts layers only
            reason = " ".join(str(error).split())[:300]
            blamed = [k for k in (options or {}) if k in reason]  # a value peft checks only when it builds a layer
            if blamed:
                raise ValueError(f"PEFTAdapters(options={dict(options or {})}): peft refused {blamed[0]} ({reason}). "
                                 f"Fix: a value peft's {METHODS[method][0]} allows for {blamed[0]}, or drop it "
                                 f"(~peft.options.{blamed[0]})") from None
            raise ValueError(f"PEFTAdapters(target_modules={[str(t) for t in target_modules]}): peft refused "
                             f"({' '.join(str(error).split())[:300]}). Fix: target layers (Linear, Embedding, Conv), "
                             "by name or class") from None
        scale_lora_down(model)  # B((A x) * scaling): the scaling on rank-wide values, no float32 copy of x under autocast
    modules = dict(model.named_modules())
    for name in keep:
        modules[name].requires_grad_(True)
    return targets


def adapter_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The ``peft`` adapter layers in ``model`` (empty for a model without adapters)."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return []
    return [(n, m) for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)]


#: Elements of each frozen tensor read into the fingerprint, evenly spaced (all of a smaller tensor).
FINGERPRINT_SAMPLE = 65_536


def frozen_fingerprint(model: nn.Module) -> str:
    """SHA-256 (16 hex digits) of the frozen tensors' names, shapes and values: the base an adapter checkpoint
    belongs to.

    Each tensor contributes up to :data:`FINGERPRINT_SAMPLE` evenly spaced elements, read in place: hashing every
    byte of a 1B-parameter base costs ~10 s of start-up and a copy of its largest tensor, and two different bases
    (another checkpoint, another fine-tune) differ at the sampled elements as everywhere else.
    """
    digest = hashlib.sha256()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    for name, tensor in model.state_dict().items():
        if name in trainable or not isinstance(tensor, torch.Tensor):
            continue
        # floating tensors as float32 values: a base read in bf16 from a bf16 file (peft.base_dtype=bf16 loads it so)
        # is the same base as that file read in float32
        kind = "float" if tensor.is_floating_point() else str(tensor.dtype)
        digest.update(f"{name}|{tuple(tensor.shape)}|{kind}".encode())
        flat = tensor.detach().reshape(-1)
        if flat.numel() > FINGERPRINT_SAMPLE:
            flat = flat[:: flat.numel() // FINGERPRINT_SAMPLE][:FINGERPRINT_SAMPLE]
        if flat.is_floating_point():
            flat = flat.float()
        if flat.numel():
            digest.update(flat.cpu().contiguous().view(torch.uint8).numpy())
    return digest.hexdigest()[:16]


def drop_frozen_from_optimizer(optimizer: torch.optim.Optimizer) -> int:
    """Remove parameters that do not require gradients from a fresh optimizer's groups; returns how many.

    A foreign ``configure_optimizers`` often passes ``self.parameters()``: frozen ones would never step but are
    listed (and, in some optimizers, get state). Groups keep their order and settings; ``param_names`` follow.
    """
    removed = 0
    for group in optimizer.param_groups:
        keep = [i for i, p in enumerate(group["params"]) if p.requires_grad]
        removed += len(group["params"]) - len(keep)
        if "param_names" in group and len(group["param_names"]) == len(group["params"]):
            group["param_names"] = [group["param_names"][i] for i in keep]
        group["params"] = [group["params"][i] for i in keep]
    return removed
