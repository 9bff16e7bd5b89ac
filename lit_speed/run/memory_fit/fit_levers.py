"""The memory levers a Hugging Face fine-tune can pull, as the fit check and ``scripts/plan.py`` see them: what a
config has on (:func:`configured_levers`), the sets tried in order of what they cost in speed (:func:`lever_sets`),
and the overrides that turn one into another (:meth:`Levers.overrides`)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from omegaconf import DictConfig

import lit_speed
from lit_speed.strategies.config_facts import ConfigFacts, config_facts


@dataclass(frozen=True)
class Levers:
    """The memory settings of a run that the estimate follows."""

    chunked_loss: bool = False
    checkpointing: bool = False
    base_bf16: bool = False      # LoRA/adapters: the frozen base held in bf16
    base_int8: bool = False      # ... or in int8 (+ a float32 scale per output row)
    low_bit_states: int = 0      # 8 or 4: torchao's AdamW states (full fine-tuning)
    micro_batch: int = 1
    lora: bool = False           # adapters (peft=lora) rather than every weight

    def overrides(self, configured: "Levers", callbacks: list[str]) -> list[str]:
        """The command-line settings that turn ``configured`` into these levers."""
        out = []
        extra = [name for flag, name in ((self.chunked_loss and not configured.chunked_loss, "chunked_loss"),
                                         (self.checkpointing and not configured.checkpointing,
                                          "activation_checkpointing")) if flag]
        if extra:
            out.append(f"'callbacks=[{','.join([*callbacks, *extra])}]'")
        if self.lora and not configured.lora:
            out.append("peft=lora")
        if self.base_bf16 and not configured.base_bf16:
            out.append("peft.base_dtype=bf16")
        if self.base_int8 and not configured.base_int8:
            out.append("peft.base_dtype=int8")
        if self.low_bit_states and not configured.low_bit_states:
            out.append(f"optimizer=adamw{self.low_bit_states}bit")
        if self.micro_batch != configured.micro_batch:
            out.append(f"data.batch_size={self.micro_batch} (with accumulation=fixed for the same effective batch)")
        return out


#: Levers tried, cheapest in speed first (each on top of the ones before): chunked loss (LoRA: faster, full
#: fine-tuning: the head's gradient per chunk), a bf16-held frozen base / 8-bit optimizer states, checkpointing
#: (one more forward per step), an int8-held base instead of bf16 (it rounds the base's values), adapters instead
#: of full fine-tuning (another method), then smaller micro-batches.
LEVERS = ("chunked_loss", "base_bf16", "low_bit_states", "checkpointing", "base_int8", "lora")


def callback_nodes(cfg: DictConfig) -> dict[str, DictConfig]:
    """``{key: node}`` of the configured callbacks (their keys name the options a lever set's overrides keep)."""
    node = cfg.get("callbacks")
    if not isinstance(node, DictConfig):
        return {}
    if "_target_" in node:
        return {"callback": node}
    return {k: v for k, v in node.items() if isinstance(v, DictConfig) and "_target_" in v}


def configured_base_dtype(facts: ConfigFacts) -> str | None:
    """How the config holds the frozen base: ``peft.base_dtype`` (``bf16``, ``int8``, ``None``), with ``auto``
    decided as ``PEFTAdapters`` decides it (:func:`lit_speed.auto_base_dtype`), from the configured precision."""
    if facts.adapters is None:
        return None
    setting = facts.adapters.get("base_dtype")
    if setting != "auto":
        return setting
    return lit_speed.auto_base_dtype(facts.precision_mode, facts.strategy.deepspeed,
                                     str(facts.adapters.get("method", "lora")))[0]


def configured_levers(cfg: DictConfig, facts: ConfigFacts | None = None) -> Levers:
    """The levers ``cfg`` has on, read from its :func:`~lit_speed.strategies.config_facts.config_facts`."""
    facts = facts or config_facts(cfg)
    lora, held = facts.lora, configured_base_dtype(facts)
    return Levers(chunked_loss=facts.chunked_loss is not None or cfg.model.get("loss_chunk_mib") is not None,
                  checkpointing=facts.checkpointing, base_bf16=lora and held == "bf16",
                  base_int8=lora and held == "int8", low_bit_states=facts.low_bit_states,
                  micro_batch=int(cfg.data.batch_size), lora=lora)


def loss_chunk_mib(cfg: DictConfig, facts: ConfigFacts | None = None) -> float | str:
    """The chunked loss's configured budget (MiB of logits, or ``"auto"``); ``"auto"`` where the config chunks
    nothing (a lever set that adds ``chunked_loss`` adds the callback's default)."""
    node = (facts or config_facts(cfg)).chunked_loss
    if node is not None:
        value = node.get("chunk_mib", "auto")
        return "auto" if value == "auto" else float(value)
    value = cfg.model.get("loss_chunk_mib") if isinstance(cfg.get("model"), DictConfig) else None
    return "auto" if value is None else float(value)


def lever_sets(configured: Levers, full_fine_tuning: bool) -> list[Levers]:
    """The configured levers, then each of :data:`LEVERS` added in turn (those that apply), then halved
    micro-batches with all of them."""
    out = [configured]
    current = configured
    for name in LEVERS:
        if name in ("base_bf16", "base_int8") and not current.lora or name == "base_bf16" and current.base_int8:
            continue
        if name == "low_bit_states" and current.lora:
            continue
        if name == "lora" and not full_fine_tuning:
            continue
        value = 8 if name == "low_bit_states" else True
        if getattr(current, name) == value:
            continue
        current = replace(current, **{name: value})
        if name == "base_int8":
            current = replace(current, base_bf16=False)
        if name == "lora":
            current = replace(current, low_bit_states=0, base_bf16=True)
        out.append(current)
    micro = current.micro_batch
    while micro > 1:
        micro //= 2
        out.append(replace(current, micro_batch=micro))
    return out


def adds_keep_freed_memory(facts: ConfigFacts) -> bool:
    """Whether ``scripts/train.py`` adds ``KeepFreedMemory`` (:func:`lit_speed.run.runner.build`): a Hugging Face
    model's run whose callbacks name neither it nor ``ReturnFreedMemory`` (its step frees blocks above glibc's 32 MiB
    mmap ceiling every step)."""
    return facts.hf_model and not (facts.callback_keys("KeepFreedMemory") or facts.callback_keys("ReturnFreedMemory"))


def keeps_freed_memory(cfg: DictConfig) -> bool:
    """Whether glibc will keep the run's freed memory for reuse: ``KeepFreedMemory`` configured, or added
    (:func:`adds_keep_freed_memory`); only where the C library is glibc (elsewhere the callback does nothing)."""
    from lit_speed.memory.allocator import glibc

    facts = config_facts(cfg)
    return glibc() is not None and bool(facts.callback_keys("KeepFreedMemory") or adds_keep_freed_memory(facts))


def base_compute(cfg: DictConfig) -> str:
    """How a bf16/int8 base computes in this run, as ``PEFTAdapters`` decides it
    (:func:`~lit_speed.finetune.frozen_base.untimed_base_compute`: ``peft.base_compute`` when it names one, ``bf16``
    under autocast); where the run would time it (``auto``, or a lever set that adds the base to a run without it):
    ``bf16`` on a CPU with native bf16 kernels (where the timing picks it: 0.25 against 1.74 s a call at 1B dims on
    XA), else ``fp32``. The two save different tensors for backward (52M Qwen2, LoRA + bf16 base computed in bf16:
    the estimate x0.869 -> x0.883 of the peak RSS once the probe computed as the run; most of the rest of that gap
    was the float32 file the base was read from, kept mapped: ``frozen_base._copy_out_of_file_maps``)."""
    from lit_speed.compat.torch import cpu_has_native_bf16
    from lit_speed.finetune.frozen_base import untimed_base_compute
    from lit_speed.precision.modes import TABLE, spec

    facts = config_facts(cfg)
    requested = str(facts.adapters.get("base_compute", "auto")) if facts.adapters is not None else "auto"
    mode = facts.precision_mode
    untimed = untimed_base_compute(requested, spec(mode).autocast_dtype if mode in TABLE else None)
    if untimed is not None:
        return untimed[0]
    return "bf16" if cpu_has_native_bf16() else "fp32"


def batch_positions(cfg: DictConfig, block: int) -> int:
    """Positions of the run's largest micro-batch: the DataModule's own answer where its class has one
    (``largest_batch_positions``: SFT's packed rows, read from the tokenized examples, which the run's data then
    finds cached), else ``batch_size x`` the window."""
    data_class = config_facts(cfg).data_class
    if data_class is not None and callable(getattr(data_class, "largest_batch_positions", None)):
        import hydra.utils

        return int(hydra.utils.instantiate(cfg.data, _convert_="all").largest_batch_positions())
    return int(cfg.data.batch_size) * block
