"""``peft``'s LoRA layer internals (peft 0.21.2): what lit_speed's merged export reads of a ``peft.tuners.lora.layer.
Linear`` to merge it by hand, pinned by ``tests/compat/test_compat.py``.

:func:`plain_lora_linear` answers whether a layer is a plain LoRA ``Linear`` (one active adapter, not merged, no DoRA
or other variant, no LoRA bias) and hands over what its merge needs; every other layer is merged by ``peft`` itself.
"""
from __future__ import annotations

from typing import Any, NamedTuple

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

    if type(layer) is not LoraLinear or layer.merged or len(layer.active_adapters) != 1:
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
