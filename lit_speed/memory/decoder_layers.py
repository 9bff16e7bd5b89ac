"""The decoder layers of a model, found without naming their class, and what checkpointing them saves.

* :func:`decoder_layer_types`: the class(es) of the repeated layer stack of any model -- a Hugging Face model's
  ``GradientCheckpointingLayer`` subclasses (``LlamaDecoderLayer``, ``Qwen2DecoderLayer``, ``GPT2Block``, the layers
  it would checkpoint itself), else the ``nn.ModuleList`` of same-class modules holding the most parameters (the
  bundled GPT's ``Block``, a user's model; under peft's wrappers too). ``ActivationCheckpointing("decoder-layers")``
  and ``checkpoint_modules(model, ["decoder-layers"])`` use it.
* :func:`decoder_layer_activation_bytes`: an analytic estimate, from a Llama-family config (RMSNorm, grouped-query
  attention through SDPA, SwiGLU MLP: Llama, Qwen2, Mistral), of the bytes autograd keeps for one decoder layer
  between forward and backward, with and without checkpointing (:class:`LayerActivationBytes`), for the planner.
* :func:`saved_bytes_per_layer`: the same bytes measured on a real model (what autograd saves inside each layer's
  forward, parameters excluded), which the estimate is tested against.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

#: The ``modules`` name that :func:`lit_speed.memory.activation_checkpointing.checkpoint_modules` resolves here.
DECODER_LAYERS = "decoder-layers"


def _hf_checkpointing_layers(root: nn.Module) -> list[type]:
    """The classes of ``root``'s Hugging Face checkpointable layers (only when transformers is already imported: a
    model that came from it has imported it)."""
    if "transformers" not in sys.modules:
        return []
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers < 4.52 has no such base class: the structural rule decides
        return []
    return list(dict.fromkeys(type(m) for m in root.modules() if isinstance(m, GradientCheckpointingLayer)))


def _largest_stack(root: nn.Module) -> list[type]:
    """The class of the ``nn.ModuleList`` of two or more same-class modules holding the most parameters (the layer
    stack; a list of experts inside each layer holds fewer than the list of layers that contains them)."""
    best, best_params = None, -1
    for module in root.modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2 and len({type(m) for m in module}) == 1:
            params = sum(p.numel() for p in module.parameters())
            if params > best_params:
                best, best_params = type(module[0]), params
    return [best] if best is not None else []


def decoder_layer_types(root: nn.Module) -> list[type]:
    """The class(es) of ``root``'s decoder layers: its Hugging Face checkpointable layers, else the largest stack.

    Raises:
        ValueError: ``root`` has neither (no repeated layer stack to checkpoint); the message says what to give.
    """
    found = _hf_checkpointing_layers(root) or _largest_stack(root)
    if not found:
        raise ValueError(f"modules=[{DECODER_LAYERS}]: {type(root).__name__} has no decoder layers (no Hugging Face "
                         "GradientCheckpointingLayer, no nn.ModuleList of same-class blocks). Fix: name the block "
                         "class to checkpoint, e.g. modules=[Block]")
    return found


@dataclass(frozen=True)
class LayerActivationBytes:
    """Bytes autograd keeps for one decoder layer between its forward and its backward."""

    kept: int          # not checkpointed: every tensor the layer's backward needs
    checkpointed: int  # checkpointed: the layer's inputs only (its activations are recomputed in backward)

    @property
    def saved(self) -> int:
        """What checkpointing one layer saves."""
        return self.kept - self.checkpointed

    def total(self, layers: int, checkpointing: bool) -> int:
        """Activation bytes of ``layers`` such layers at the end of the forward; checkpointed, backward recomputes one
        layer at a time, so one layer's ``kept`` comes on top while it runs."""
        return layers * self.checkpointed + self.kept if checkpointing else layers * self.kept


def decoder_layer_activation_bytes(hidden_size: int, intermediate_size: int, num_attention_heads: int,
                                   num_key_value_heads: int, tokens: int, dtype: torch.dtype = torch.float32,
                                   head_dim: int | None = None) -> LayerActivationBytes:
    """Analytic activation bytes of one Llama-family decoder layer (RMSNorm, GQA through SDPA, SwiGLU) for
    ``tokens`` = micro-batch x sequence length, all computed in ``dtype`` (32-true, bf16-true; under autocast
    measure instead: :func:`saved_bytes_per_layer`).

    Per token, what the layer's backward needs (read from what torch 2.13 and transformers 5 save, checked against
    :func:`saved_bytes_per_layer` in ``tests/memory/test_decoder_layers.py``): each RMSNorm keeps its input and one
    reciprocal RMS in float32 (it normalises in float32 whatever the dtype) and the normalised and the scaled output in
    ``dtype`` (twice); SDPA keeps q, k, v and its output in ``dtype`` and one float32 log-sum-exp per head (no
    ``s x s`` matrix; the output projection reads SDPA's output in place); the MLP keeps gate, SiLU(gate), up and
    their product (``4 i``). Checkpointed, the layer keeps only its input (``h``). The rotary tables are shared by all
    layers (not counted).

    Example::

        decoder_layer_activation_bytes(896, 4864, 14, 2, tokens=4 * 512)  # Qwen2.5-0.5B's layer, fp32
    """
    head_dim = head_dim or hidden_size // num_attention_heads
    q, kv, width, f32 = num_attention_heads * head_dim, num_key_value_heads * head_dim, dtype.itemsize, 4
    norms = 2 * ((hidden_size + 1) * f32 + 2 * hidden_size * width)
    attention = (2 * q + 2 * kv) * width + num_attention_heads * f32
    per_token = norms + attention + 4 * intermediate_size * width
    return LayerActivationBytes(kept=per_token * tokens, checkpointed=hidden_size * tokens * width)


def decoder_layer_activation_bytes_of(config: Any, tokens: int, dtype: torch.dtype = torch.float32
                                      ) -> LayerActivationBytes:
    """:func:`decoder_layer_activation_bytes` from a Hugging Face config (``hidden_size``, ``intermediate_size``,
    ``num_attention_heads``, ``num_key_value_heads``, ``head_dim`` if it sets one)."""
    heads = config.num_attention_heads
    return decoder_layer_activation_bytes(config.hidden_size, config.intermediate_size, heads,
                                          getattr(config, "num_key_value_heads", None) or heads, tokens, dtype,
                                          getattr(config, "head_dim", None))


def saved_bytes_per_layer(model: nn.Module, forward: Callable[[], Any]) -> dict[str, int]:
    """Bytes autograd saves for backward inside each decoder layer of ``model`` while ``forward()`` runs, each
    storage once, parameters (and views of them) excluded: ``{layer name: bytes}``.

    A checkpointed layer counts what its checkpoint keeps (its inputs); the recomputation in backward is not run.
    """
    types = tuple(decoder_layer_types(model))
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    counted: dict[str, dict[int, int]] = {}
    inside: list[str] = []
    names = {module: name for name, module in model.named_modules() if isinstance(module, types)}
    seen: set[int] = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if inside and key not in parameters and key not in seen and storage.nbytes():
            seen.add(key)
            counted.setdefault(inside[-1], {})[key] = storage.nbytes()
        return tensor

    def enter(module: nn.Module, args: Any) -> None:
        inside.append(names[module])

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        inside.pop()

    handles = [h for m in names for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            forward()
    finally:
        for handle in handles:
            handle.remove()
    return {name: sum(counted.get(name, {}).values()) for name in names.values()}
