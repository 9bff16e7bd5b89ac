"""``base_dtype=auto``: how a frozen base under adapters is held, decided from the precision mode.

The decision is one function, :func:`auto_base_dtype`, asked by the runner (from the config, before the weights
load), by the fit check's levers and by ``PEFTAdapters`` alone at setup (from the Trainer's precision); the holding
itself is :mod:`lit_speed.finetune.frozen_base`.
"""
from __future__ import annotations

import torch

from lit_speed.precision import modes as precision_table

#: ``base_dtype=auto``: one of ``frozen_base.BASE_DTYPES`` or as loaded, decided by :func:`auto_base_dtype`
AUTO = "auto"


def auto_base_dtype(precision_mode: str | None, zero: bool = False, method: str = "lora") -> tuple[str | None, str]:
    """What ``base_dtype=auto`` holds the frozen base in (``bf16``, or ``None``: as loaded), and why.

    ``bf16`` under a mode that autocasts float32 module weights to bf16 (``bf16-mixed``): every frozen matmul there
    runs on a bf16 copy of its weight, cast again at each forward and backward; held in bf16 the matmuls are the
    same, without the casts (0.5B LoRA on a Xeon with AMX: 4.3-4.6 s a step against 6.3), in half the bytes.
    Embedding rows are then read from bf16 values (the one change to the math; they become float32 activations).
    As loaded everywhere else: a float32 or fp16 mode keeps its own matmuls, DeepSpeed ZeRO partitions the
    parameters itself, ``precision=auto`` decides its mode later, ``method=freeze`` has no adapters.
    """
    if method == "freeze":
        return None, "method=freeze has no adapters"
    if zero:
        return None, "DeepSpeed ZeRO casts and partitions the parameters itself"
    if precision_mode is None:
        return None, "no precision set: float32 matmuls"
    found = precision_table.TABLE.get(str(precision_mode))
    if found is None:  # precision=auto (chosen at fit start), or a literal outside lit_speed's mode table
        return None, f"precision={precision_mode} is not known before fit start: the base as loaded fits every mode"
    if found.autocast_dtype == torch.bfloat16 and found.weight_dtype == torch.float32:
        return "bf16", (f"precision={precision_mode} casts every frozen matmul weight to bf16 at each forward and "
                        "backward: held in bf16, the same matmuls without the casts, half the bytes")
    return None, f"precision={precision_mode} does not compute the frozen matmuls in bf16"
