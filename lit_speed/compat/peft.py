"""``peft``'s LoRA layer internals (peft 0.21.2): what lit_speed's merged export reads of a ``peft.tuners.lora.layer.
Linear`` to merge it by hand, pinned by ``tests/compat/test_compat.py``.

:func:`plain_lora_linear` answers whether a layer is a plain LoRA ``Linear`` (one active adapter, not merged, no DoRA
or other variant, no LoRA bias) and hands over what its merge needs; every other layer is merged by ``peft`` itself.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
from torch import nn

PEFT_VERSION = "0.21.2"  # the version these helpers were written and tested against


class PlainLora(NamedTuple):
    """The one adapter of a plain LoRA ``Linear``: its down (``lora_A``) and up (``lora_B``) projections, the scale
    of their product and whether the base weight is stored transposed (``fan_in_fan_out``: GPT-2's ``Conv1D``)."""

    adapter: str
    down: nn.Module
    up: nn.Module
    scaling: float
    fan_in_fan_out: bool


def plain_lora_linear(layer: nn.Module) -> PlainLora | None:
    """``layer``'s adapter when it is a plain LoRA ``Linear`` (``peft.tuners.lora.layer.Linear`` itself, one active
    adapter, not merged, no variant in ``lora_variant`` such as DoRA, no ``lora_bias``); None for any other layer."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    if type(layer) not in (LoraLinear, _scaled_down_class()) or layer.merged or len(layer.active_adapters) != 1:
        return None
    adapter = layer.active_adapters[0]
    if adapter not in layer.lora_A or adapter in layer.lora_variant or layer.lora_bias[adapter]:
        return None
    return PlainLora(adapter, layer.lora_A[adapter], layer.lora_B[adapter], layer.scaling[adapter],
                     bool(layer.fan_in_fan_out))


def transpose_for(weight: Any, fan_in_fan_out: bool) -> Any:
    """``weight`` as ``peft`` lays it out for a base stored transposed (``peft.utils.other.transpose``)."""
    from peft.utils.other import transpose

    return transpose(weight, fan_in_fan_out)


@functools.cache
def _scaled_down_class() -> type:
    """:class:`ScaledDownLoraLinear`'s class, made once when ``peft`` is first needed (it subclasses peft's Linear)."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    def forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        lora = plain_lora_linear(self)
        if lora is None or self.disable_adapters or args or kwargs:  # peft's own forward for everything else
            return LoraLinear.forward(self, x, *args, **kwargs)
        self._check_forward_args(x)
        result = self.base_layer(x)
        if not torch.is_autocast_enabled(x.device.type):  # under autocast the matmul casts x itself, once
            x = self._cast_input_dtype(x, lora.down.weight.dtype)
        low = lora.down(self.lora_dropout[lora.adapter](x))
        return (result + lora.up(low * lora.scaling)).to(result.dtype)

    return type("ScaledDownLoraLinear", (LoraLinear,), {
        "forward": forward, "__module__": __name__,
        "__doc__": "peft's LoRA ``Linear`` scaling the rank-wide activation (see :func:`scale_lora_down`)."})


def scale_lora_down(model: nn.Module) -> int:
    """Give every plain LoRA ``Linear`` of ``model`` (:func:`plain_lora_linear`) a forward that computes
    ``base(x) + B((A x) * scaling)`` instead of peft's ``base(x) + B(A x) * scaling``; returns how many.

    The scaling multiplies ``tokens x r`` values instead of ``tokens x width`` ones (and their gradient), and under
    autocast the input is not first cast to the adapter's float32 (a copy that autocast casts back to 16 bits for the
    matmul, twice more in backward, and a second saved copy of the layer's input): 0.5B LoRA r=8 under bf16 autocast,
    0.3-0.5 s of a 4.4 s step on a Xeon with AMX. The same values where ``scaling`` is a power of two (``alpha = 2 r``,
    peft's usual); otherwise within one rounding of the product. Parameters, ``state_dict``, ``isinstance`` and the
    merge are peft's: the class changes in place, as ``lit_speed.finetune.adapter_grad`` changes ``lora_B``'s.
    A layer that is not plain (merged, DoRA, several adapters, mixed-batch ``adapter_names``) runs peft's forward.
    """
    count = 0
    for module in model.modules():
        if plain_lora_linear(module) is not None:
            module.__class__ = _scaled_down_class()
            count += 1
    return count
