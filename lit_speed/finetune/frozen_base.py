"""A frozen base held in bf16 or int8 under adapters, computed in float32 or bf16, whichever is faster here.

The functional core of ``PEFTAdapters(base_dtype="bf16" | "int8")``; usable without Lightning::

    add_adapters(model, "lora", ["all-linear"])            # the base is frozen, the adapters float32
    lowered = lower_frozen_base(model, compute="fp32")     # frozen Linear/Embedding weights now bf16: half the bytes
    lowered = lower_frozen_base(model, torch.int8)         # or int8 + a float32 scale per output row: a quarter

**int8** (a module's ``held_weight_scale`` attribute holds its scales: code that reads ``.weight`` itself, as the
chunked LM loss does, multiplies by it) is symmetric absmax quantization per output channel (a Linear's row, an Embedding's row - the same rows
when an LM head is tied to its embedding -, a GPT-2 ``Conv1D``'s column): ``w ~ q * scale``, ``q`` in -127..127,
the scheme of torchao's int8 weight-only config. Each matmul dequantizes its own layer's weight to the compute
dtype (as the bf16 path casts it) and backward does so again from the int8 weight, so the same autograd function
serves both and the adapters train against exactly the dequantized base. torchao's tensor subclass is not used:
this path needs the input gradient through every frozen matmul and the merged float32 export, in one code path
for Linear, Conv1D and tied Embeddings. The quantization error (at most half a step, ``scale / 2``, per weight) is
a change to the base: the export writes the dequantized base plus the merged adapters.

*Held* and *computed* are separate: on a CPU without native bf16 kernels (AVX512-BF16/AMX) a bf16 matmul is 50-500x
slower than a float32 one, so ``compute="fp32"`` casts each frozen weight to float32 just for its own matmul (one
layer's transient copy, never the whole model) and backward casts again from the stored bf16 weight instead of
keeping a float32 copy; ``compute="bf16"`` runs the matmul in bf16 (fast on Zen4/Zen5/AMX). Activations stay in
the precision mode's dtype either way. :func:`choose_base_compute` decides ``auto`` by timing both on this model's
largest frozen layer (``lit_speed.tuning.measured_choice``, cached per machine).

Only frozen weights of plain ``nn.Linear``, ``nn.Embedding`` and Hugging Face ``Conv1D`` modules are lowered
(subclasses may compute more than their class, e.g. a scaled embedding: they stay float32); 1-D tensors (biases,
norms) stay float32. Tied weights are one tensor and are lowered once. Adapters, their gradients and the
optimizer's state stay float32.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from lit_speed.compat.torch import cpu_has_native_bf16
from lit_speed.tuning import Decision, measured_choice

BASE_DTYPES = {"bf16": torch.bfloat16, "int8": torch.int8}
INT8_MAX = 127
COMPUTES = ("auto", "fp32", "bf16")
COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _kind(module: nn.Module) -> str | None:
    cls = getattr(type(module), "lit_speed_base_class", type(module))  # a lowered module: its class before
    if cls is nn.Linear:
        return "linear"
    if cls.__name__ == "Conv1D" and isinstance(getattr(module, "weight", None), torch.Tensor):
        return "conv1d"  # Hugging Face GPT-2's Linear: weight [in, out], y = x @ W + b
    if cls is nn.Embedding:
        return "embedding"
    return None


class _UpcastMatmul(torch.autograd.Function):
    """``x @ W.T + b`` with a low-precision frozen ``W`` cast to ``x``'s dtype for this matmul only; backward casts
    again from the stored ``W`` (no float32 copy is kept between forward and backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                transposed: bool, scale: torch.Tensor | None = None) -> torch.Tensor:
        if ctx.needs_input_grad[1]:
            raise RuntimeError("a low-precision frozen weight requires grad: unfreeze it before lowering the base "
                               "(lit_speed.finetune.frozen_base lowers frozen weights only)")
        w = dequantized(weight, scale, x.dtype)
        ctx.save_for_backward(weight, scale)
        ctx.transposed = transposed
        ctx.bias_shape = None if bias is None else bias.shape
        return F.linear(x, w.t() if transposed else w, None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        weight, scale = ctx.saved_tensors
        w = dequantized(weight, scale, grad.dtype)
        grad_x = grad @ (w.t() if ctx.transposed else w) if ctx.needs_input_grad[0] else None
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.needs_input_grad[2] else None
        return grad_x, None, grad_b, None, None


def dequantized(weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` in ``dtype``: a cast, or ``q * scale`` for an int8 weight (``scale`` broadcasts: one per output
    channel)."""
    if scale is None:
        return weight.to(dtype)
    return (weight.to(torch.float32) * scale).to(dtype)  # the product in float32, then the compute dtype


def quantize_int8(weight: torch.Tensor, channel_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: symmetric absmax int8 per channel along ``channel_dim`` (``scale`` keeps ``weight``'s rank,
    1 elsewhere; a channel of zeros gets scale 1). Computed one block of channels at a time in float32, so the
    float32 temporaries stay small for a 150k-row embedding."""
    w = weight.detach()
    amax = w.abs().amax(dim=1 - channel_dim, keepdim=True).float()
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    step = max(1, (1 << 22) // max(w.shape[1 - channel_dim], 1))
    for start in range(0, w.shape[channel_dim], step):
        block = w.narrow(channel_dim, start, min(step, w.shape[channel_dim] - start)).float()
        s = scale.narrow(channel_dim, start, block.shape[channel_dim])
        q.narrow(channel_dim, start, block.shape[channel_dim]).copy_(
            torch.round(block / s).clamp_(-INT8_MAX, INT8_MAX))
    return q, scale


def _low_precision_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``forward`` of a lowered module (its class is a subclass made by :func:`_lowered_class`): what it computes is
    read from plain attributes (``lit_speed_kind``, ``lit_speed_compute``, ``held_weight_scale``), so one
    ``torch.compile`` graph serves every decoder layer (a ``forward`` object per instance made it guard on each
    object's identity and compile each layer again, up to its recompile limit)."""
    kind, scale = self.lit_speed_kind, getattr(self, "held_weight_scale", None)
    if kind == "embedding":  # gather the low-precision rows, then float32 activations
        rows = F.embedding(x, self.weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq,
                           self.sparse).float()
        return rows if scale is None else rows * F.embedding(x, scale)
    device = x.device.type
    if self.lit_speed_compute == "bf16" or torch.is_autocast_enabled(device):
        # the matmul in bf16 (autocast's dtype under a mixed mode casts the same way), the result in x's dtype
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else torch.bfloat16
        w = dequantized(self.weight, scale, dtype)
        b = None if self.bias is None else self.bias.to(dtype)
        y = F.linear(x.to(dtype), w.t() if kind == "conv1d" else w, b)
        return y if torch.is_autocast_enabled(device) else y.to(x.dtype)
    return _UpcastMatmul.apply(x, self.weight, self.bias, kind == "conv1d", scale)


_LOWERED_CLASSES: dict[type, type] = {}


def _is_lowered(module: nn.Module) -> bool:
    """Whether :func:`lower_frozen_base` gave ``module`` its low-precision class."""
    return getattr(type(module), "lit_speed_base_class", None) is not None


def _lowered_class(cls: type) -> type:
    """The subclass of ``cls`` a lowered module becomes in place (one per class, so compiled code matches all)."""
    if cls not in _LOWERED_CLASSES:
        _LOWERED_CLASSES[cls] = type(f"LowPrecision{cls.__name__}", (cls,), {
            "forward": _low_precision_forward, "lit_speed_base_class": cls, "__module__": __name__})
    return _LOWERED_CLASSES[cls]


@dataclass
class LoweredBase:
    """What :func:`lower_frozen_base` did: tensors lowered, their bytes before and after, the modules wrapped."""

    tensors: int
    bytes_before: int
    bytes_after: int
    modules: list[str]

    @property
    def saved_bytes(self) -> int:
        return self.bytes_before - self.bytes_after


def lower_frozen_base(model: nn.Module, dtype: torch.dtype = torch.bfloat16, compute: str = "fp32") -> LoweredBase:
    """Hold the frozen weights of ``model``'s Linear/Embedding/Conv1D modules in ``dtype``, in place.

    The Parameter objects stay the same (optimizers, tied weights and hooks keep working); only their data changes.

    Args:
        model: Any module, after its adapters are in place (only tensors that do not require grad are lowered).
        dtype: The storage dtype: ``torch.bfloat16``, or ``torch.int8`` (with a float32 scale per output channel,
            kept in the module's ``held_weight_scale``; tied weights share one).
        compute: ``fp32`` (cast each weight for its own matmul) or ``bf16`` (native bf16 matmuls); see
            :func:`set_base_compute` to change it later.

    Raises:
        ValueError: An unknown ``compute``.
    """
    if compute not in COMPUTE_DTYPES:
        raise ValueError(f"lower_frozen_base(compute={compute!r}): one of {', '.join(COMPUTE_DTYPES)}")
    if dtype not in BASE_DTYPES.values():
        raise ValueError(f"lower_frozen_base(dtype={dtype}): one of {', '.join(map(str, BASE_DTYPES.values()))}")
    lowered: dict[int, torch.Tensor] = {}
    scales: dict[int, torch.Tensor] = {}
    before = after = 0
    names = []
    for name, module in model.named_modules():
        kind = _kind(module)
        weight = getattr(module, "weight", None)
        eligible = kind is not None and not _is_lowered(module) and isinstance(weight, nn.Parameter) \
            and not weight.requires_grad and weight.dim() >= 2
        # floating, or a tied weight an earlier module of this call quantized (an LM head tied to its embedding)
        if not eligible or not (weight.is_floating_point() or id(weight) in scales):
            continue
        if id(weight) not in lowered and weight.dtype != dtype:
            before += weight.numel() * weight.element_size()
            if dtype == torch.int8:
                weight.data, scales[id(weight)] = quantize_int8(weight.data, 1 if kind == "conv1d" else 0)
                after += scales[id(weight)].numel() * 4
            else:
                weight.data = weight.data.to(dtype)
            after += weight.numel() * weight.element_size()
            lowered[id(weight)] = weight
        module.__class__ = _lowered_class(type(module))
        module.lit_speed_kind, module.lit_speed_compute = kind, compute
        if id(weight) in scales:  # the contract for code that reads .weight itself (the chunked LM loss)
            module.held_weight_scale = scales[id(weight)]
        names.append(name)
    if lowered:
        _copy_out_of_file_maps(model)
    return LoweredBase(len(lowered), before, after, names)


def _file_mapped_ranges() -> list[tuple[int, int]]:
    """Address ranges of this process mapped from files (``/proc/self/maps``; empty where there is none)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[4] != "0" and not fields[5].startswith("["):
            start, end = fields[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return sorted(ranges)


def _copy_out_of_file_maps(model: nn.Module) -> int:
    """Copy the tensors of ``model`` that still point into a memory-mapped file (returns how many).

    transformers reads a safetensors file whose dtype is the one asked for without a copy: every tensor is a view of
    one mapping of the file, and the mapping stays as long as any of them lives. Lowering the base replaces the large
    weights, but the norms and biases it leaves would keep the whole float32 file mapped, its read pages counted in
    the RSS (52M Qwen2, LoRA + bf16 base: 0.81 GiB at the first step against 0.71 with the float32 base it replaced).
    They are small: copied, the mapping goes."""
    ranges = _file_mapped_ranges()
    if not ranges:
        return 0
    starts = [start for start, _ in ranges]

    def mapped(tensor: torch.Tensor) -> bool:
        at = bisect.bisect_right(starts, tensor.data_ptr()) - 1
        return tensor.device.type == "cpu" and tensor.numel() > 0 and at >= 0 and tensor.data_ptr() < ranges[at][1]

    copied = 0
    for parameter in model.parameters():  # each shared (tied) Parameter once
        if mapped(parameter):
            parameter.data, copied = parameter.data.clone(), copied + 1
    for module in model.modules():
        for key, buffer in list(module.named_buffers(recurse=False)):
            if mapped(buffer):
                setattr(module, key, buffer.clone())  # nn.Module keeps a registered buffer's name a buffer
                copied += 1
    return copied


def set_base_compute(model: nn.Module, compute: str) -> int:
    """Make every lowered module of ``model`` compute in ``compute`` (``fp32`` or ``bf16``); returns how many."""
    if compute not in COMPUTE_DTYPES:
        raise ValueError(f"set_base_compute(compute={compute!r}): one of {', '.join(COMPUTE_DTYPES)}")
    wrapped = [m for m in model.modules() if _is_lowered(m)]
    for module in wrapped:
        module.lit_speed_compute = compute
    return len(wrapped)


def unwrap_frozen_base(model: nn.Module) -> int:
    """Give the modules :func:`lower_frozen_base` changed their classes back (the weights keep their dtype); returns
    how many."""
    wrapped = [m for m in model.modules() if _is_lowered(m)]
    for module in wrapped:
        module.__class__ = type(module).lit_speed_base_class
        for name in ("lit_speed_kind", "lit_speed_compute", "held_weight_scale"):
            if name in vars(module):
                delattr(module, name)
    return len(wrapped)


def dequantize_frozen_base(model: nn.Module) -> int:
    """Undo :func:`lower_frozen_base` on ``model`` in place: int8 weights become their float32 values (``q *
    scale``), bf16 ones stay bf16 (their float32 values are exact), the forward wrappers go. For a copy of one layer
    before merging its adapters (the export); returns how many modules were unwrapped."""
    for module in model.modules():
        scale = getattr(module, "held_weight_scale", None)
        if _is_lowered(module) and scale is not None and module.weight.dtype == torch.int8:
            module.weight.data = dequantized(module.weight.data, scale, torch.float32)
    return unwrap_frozen_base(model)


def int8_scales(model: nn.Module) -> dict[int, torch.Tensor]:
    """``id(weight) -> scale`` of ``model``'s int8-held frozen weights (tied weights once)."""
    return {id(m.weight): m.held_weight_scale for m in model.modules()
            if _is_lowered(m) and getattr(m, "held_weight_scale", None) is not None
            and m.weight.dtype == torch.int8}


def upcast_unlowered(model: nn.Module, dtype: torch.dtype = torch.float32) -> int:
    """Cast every floating parameter and buffer of ``model`` held in bf16/fp16 to ``dtype``, except the weights
    :func:`lower_frozen_base` lowered; returns how many tensors changed. A model read in bf16 from a bf16 file (to
    skip a float32 copy of the whole base while loading) becomes the model read in float32 and then lowered."""
    keep = {id(m.weight) for m in model.modules() if _is_lowered(m)}
    changed = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in keep or not tensor.is_floating_point() or tensor.dtype not in (torch.bfloat16, torch.float16):
            continue
        tensor.data = tensor.data.to(dtype)
        changed += 1
    return changed


def frozen_base_bytes(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
    """``(bytes now, bytes held in dtype)`` of the frozen weights :func:`lower_frozen_base` would lower: the planner's
    question "what does a low-precision base save" (tied weights counted once)."""
    seen: dict[int, torch.Tensor] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if _kind(module) and isinstance(weight, nn.Parameter) and not weight.requires_grad \
                and weight.is_floating_point() and weight.dim() >= 2:
            seen[id(weight)] = weight
    now = sum(w.numel() * w.element_size() for w in seen.values())
    return now, sum(w.numel() * dtype.itemsize for w in seen.values())


def _largest_linear(model: nn.Module) -> tuple[int, int] | None:
    shapes = [tuple(m.weight.shape) for m in model.modules() if _is_lowered(m)
              and m.lit_speed_kind != "embedding"]
    return max(shapes, key=lambda s: s[0] * s[1]) if shapes else None


#: The most weight elements :func:`choose_base_compute` times on: the largest layer's first rows up to this many. A
#: matmul's time per element is the same over more rows, and the whole of a large vocabulary's head (a 1B model's
#: 128256 x 2048) made 2.1 GB of float32 probe tensors at fit start, the run's peak RSS (1B-dims LoRA preset, XA).
PROBE_WEIGHT_ELEMENTS = 1 << 24


def untimed_base_compute(requested: str, autocast_dtype: torch.dtype | None) -> tuple[str, str] | None:
    """``(compute, reason)`` of ``base_compute=requested`` where nothing needs timing: a named one, or ``bf16`` under
    an autocast (its matmuls run in low precision anyway); ``None``: ``auto`` without autocast, which
    :func:`choose_base_compute` times."""
    if requested != "auto":
        return requested, "requested"
    if autocast_dtype is not None:
        return "bf16", f"autocast runs the matmuls in {autocast_dtype}"
    return None


def choose_base_compute(model: nn.Module, device: torch.device | str = "cpu", tokens: int = 256,
                        measure: Callable[..., Decision] = measured_choice) -> Decision:
    """``fp32`` or ``bf16`` for the lowered base of ``model``, measured on this machine where it matters.

    Without native bf16 kernels (a CPU without AVX512-BF16/AMX, a GPU without bf16) bf16 is not timed (emulated
    bf16 matmuls are 50-500x slower). Otherwise one forward and input-gradient matmul of the largest lowered layer
    (at most :data:`PROBE_WEIGHT_ELEMENTS` of it) with ``tokens`` rows is timed both ways (``measure``:
    :func:`lit_speed.tuning.measured_choice`, cached per machine and shape); ``fp32`` is kept unless bf16 is faster by
    the usual margin.
    """
    device = torch.device(device)
    name = "peft.base_compute"
    native = torch.cuda.is_bf16_supported() if device.type == "cuda" else cpu_has_native_bf16()
    if not native:
        return Decision(name, "fp32", f"no native bf16 kernels on this {device.type}: bf16 matmuls would be "
                                      "emulated (50-500x slower than float32); bf16 not timed")
    shape = _largest_linear(model)
    if shape is None:
        return Decision(name, "fp32", "no lowered Linear layer to time")
    out_features, in_features = shape
    out_features = min(out_features, max(PROBE_WEIGHT_ELEMENTS // in_features, 1))
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(tokens, in_features, generator=gen).to(device).requires_grad_()
    w = torch.randn(out_features, in_features, generator=gen).to(device, torch.bfloat16)
    probe = nn.Linear(in_features, out_features, bias=False, device="meta")  # no float32 weight made, none initialised
    probe.weight = nn.Parameter(w, requires_grad=False)
    probe.__class__ = _lowered_class(nn.Linear)
    probe.lit_speed_kind = "linear"

    def run(compute: str) -> Callable[[], Any]:
        def call() -> None:
            probe.lit_speed_compute = compute
            probe(x).sum().backward()
            x.grad = None
        return call

    return measure(name, {"shape": [out_features, in_features], "tokens": tokens, "device": device.type},
                   {"fp32": run("fp32"), "bf16": run("bf16")}, default="fp32")
