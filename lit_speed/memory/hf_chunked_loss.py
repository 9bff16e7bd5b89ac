"""A Hugging Face causal LM that computes its loss in chunks when it is called with ``labels``.

:func:`chunk_hf_loss` replaces ``forward`` on the model instance (its class, its ``state_dict`` keys and every other
instance are untouched, as Liger-Kernel's patching does per class): a call with ``labels`` runs the decoder
(``model.base_model``), then :func:`~lit_speed.memory.chunked_lm_loss.chunked_lm_loss` on its last hidden state and the
output embedding's weight, so ``lm_head`` is never applied to all tokens; ``outputs.logits`` is ``None`` then.
A call without ``labels`` is the model's own forward. Labels are shifted as Hugging Face does (or ``shift_labels``
is used), ``num_items_in_batch`` and ``ignore_index`` keep their meaning.

Before it wraps a model, :func:`hf_lm_head` checks on a few tokens that the model's logits *are* the head applied
to the decoder's output (with the logit scaling or soft-capping its config declares): a model whose forward does
something else to them (a transform lit_speed does not know, an auxiliary loss) is refused, never silently changed.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lit_speed.memory.chunked_lm_loss import DEFAULT_CHUNK_MIB, chunked_lm_loss

_ATTR = "_lit_speed_chunked_loss"
#: Arguments of a causal LM's forward that only its loss function reads.
LOSS_ARGUMENTS = ("num_items_in_batch", "shift_labels", "ignore_index")
PROBE_TOKENS = 8


@dataclass(frozen=True)
class LMHead:
    """Where a Hugging Face causal LM's logits come from: ``scale * (decoder(x) @ head.weight.T + head.bias)``,
    soft-capped at ``softcap``."""

    decoder: nn.Module
    head: nn.Module
    logit_scale: float = 1.0
    softcap: float | None = None

    def loss_options(self) -> dict[str, Any]:
        """The logit transform, as :func:`chunked_lm_loss` keywords."""
        return {"logit_scale": self.logit_scale, "softcap": self.softcap}


def is_hf_causal_lm(module: nn.Module) -> bool:
    """A ``transformers`` model class registered for ``AutoModelForCausalLM`` (``LlamaForCausalLM``, ``GPT2LMHeadModel``)."""
    if not (hasattr(module, "config") and hasattr(module, "get_output_embeddings")):
        return False
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return False
    return type(module).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def _logit_transform(model: nn.Module) -> tuple[float, float | None]:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    scale = float(getattr(config, "logit_scale", None) or 1.0)  # Cohere: logits * logit_scale
    if getattr(config, "logits_scaling", None):  # Granite: logits / logits_scaling
        scale /= float(config.logits_scaling)
    softcap = getattr(config, "final_logit_softcapping", None)  # Gemma 2/3
    return scale, None if softcap is None else float(softcap)


def hf_lm_head(model: nn.Module, check: bool = True, owner: str = "ChunkedLMLoss") -> LMHead:
    """The decoder, head and logit transform of a Hugging Face causal LM, checked on ``PROBE_TOKENS`` tokens.

    Raises:
        ValueError: Not a causal LM with a Linear output embedding; a model that adds an auxiliary loss (MoE router
            logits); or logits that differ from the transformed head of the decoder's output on the probe.
    """
    name = type(model).__name__
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    decoder = getattr(model, "base_model", model)
    if not isinstance(head, nn.Linear) or decoder is model:
        raise ValueError(f"{owner}: {name} has no Linear output embedding over a base model (get_output_embeddings, "
                         "base_model): the chunked loss needs the decoder's hidden states and the head's weight. "
                         "Fix: leave the loss unchunked for this model")
    if getattr(model.config, "output_router_logits", False):
        raise ValueError(f"{owner}: {name} adds its router's auxiliary loss to the language-model loss "
                         "(config.output_router_logits=True), which the chunked loss does not compute. Fix: "
                         "config.output_router_logits=false, or leave the loss unchunked")
    scale, softcap = _logit_transform(model)
    spec = LMHead(decoder, head, scale, softcap)
    if check:
        _check_probe(model, spec, owner)
    return spec


def _check_probe(model: nn.Module, spec: LMHead, owner: str) -> None:
    """Compare the model's own logits with the transformed head of the decoder's output (eval mode, no grad)."""
    modes = {m: m.training for m in model.modules()}
    device = spec.head.weight.device
    ids = (torch.arange(PROBE_TOKENS, device=device) % spec.head.weight.shape[0]).unsqueeze(0)
    try:
        model.eval()
        with torch.no_grad():
            forward = type(model).forward.__get__(model)
            reference = forward(input_ids=ids, use_cache=False).logits.float()
            ours = spec.head(spec.decoder(input_ids=ids, use_cache=False)[0]).float() * spec.logit_scale
            if spec.softcap is not None:
                ours = torch.tanh(ours / spec.softcap) * spec.softcap
    finally:
        for module, training in modes.items():
            module.train(training)
    difference = float((reference - ours).abs().max())
    if not difference <= 1e-3 * (1.0 + float(reference.abs().max())):
        raise ValueError(f"{owner}: {type(model).__name__}'s logits are not its head applied to its decoder's output "
                         f"(scale {spec.logit_scale:g}, soft-cap {spec.softcap}): they differ by {difference:.3g} on a "
                         f"{PROBE_TOKENS}-token probe, so its forward does more than the chunked loss would. Fix: "
                         "leave the loss unchunked for this model")


class _ChunkedLossForward:
    """Replaces ``forward`` on the instance; keeps a reference to its module so ``copy.deepcopy`` copies it along."""

    def __init__(self, model: nn.Module, spec: LMHead, chunk_bytes: int) -> None:
        self.model = model
        self.spec = spec
        self.chunk_bytes = chunk_bytes
        self.signature = inspect.signature(type(model).forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = type(self.model).forward.__get__(self.model)
        bound = self.signature.bind(self.model, *args, **kwargs).arguments
        bound.pop(next(iter(self.signature.parameters)))  # self
        for name, parameter in self.signature.parameters.items():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                bound.update(bound.pop(name, {}))
        labels = bound.pop("labels", None)
        keep = bound.pop("logits_to_keep", 0)
        if labels is None or (keep not in (0, None)):
            return forward(*args, **kwargs)
        loss_args = {k: bound.pop(k) for k in LOSS_ARGUMENTS if k in bound}
        return_dict = bound.pop("return_dict", None)
        outputs = self.spec.decoder(**bound)
        ignore = loss_args.get("ignore_index", -100)
        targets = loss_args.get("shift_labels")
        if targets is None:  # as Hugging Face's ForCausalLMLoss: tokens < n predict n
            targets = F.pad(labels, (0, 1), value=ignore)[..., 1:]
        loss = chunked_lm_loss(outputs[0], self.spec.head.weight, targets, self.spec.head.bias,
                               chunk_bytes=self.chunk_bytes, ignore_index=ignore,
                               num_items_in_batch=loss_args.get("num_items_in_batch"),
                               weight_scale=getattr(self.spec.head, "held_weight_scale", None),
                               **self.spec.loss_options())
        from transformers.modeling_outputs import CausalLMOutputWithPast

        result = CausalLMOutputWithPast(loss=loss, logits=None, cache=getattr(outputs, "cache", None),
                                        hidden_states=getattr(outputs, "hidden_states", None),
                                        attentions=getattr(outputs, "attentions", None))
        return result.to_tuple() if return_dict is False else result


def chunk_hf_loss(model: nn.Module, chunk_bytes: int = DEFAULT_CHUNK_MIB * 2**20, check: bool = True,
                  owner: str = "ChunkedLMLoss") -> bool:
    """Make ``model`` (a Hugging Face causal LM) compute its loss chunked when called with ``labels``, in place.

    Returns:
        ``True`` when it was wrapped now, ``False`` when it already was.

    Raises:
        ValueError: See :func:`hf_lm_head`.
    """
    if getattr(model, _ATTR, False):
        return False
    spec = hf_lm_head(model, check=check, owner=owner)
    model.forward = _ChunkedLossForward(model, spec, int(chunk_bytes))
    setattr(model, _ATTR, True)
    return True


def set_chunk_bytes(model: nn.Module, chunk_bytes: int) -> bool:
    """Change the chunk budget of a model :func:`chunk_hf_loss` wrapped; returns whether it was wrapped."""
    forward = model.__dict__.get("forward")
    if not (getattr(model, _ATTR, False) and isinstance(forward, _ChunkedLossForward)):
        return False
    forward.chunk_bytes = int(chunk_bytes)
    return True


def unchunk_hf_loss(model: nn.Module) -> bool:
    """Undo :func:`chunk_hf_loss`; returns whether ``model`` was wrapped."""
    if not getattr(model, _ATTR, False):
        return False
    del model.forward
    delattr(model, _ATTR)
    return True
