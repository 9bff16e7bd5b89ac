"""Functional core of :class:`~lit_speed.strategies.zero_strategy.ZeroStrategy`: DeepSpeed config checks.

DeepSpeed reads its config with ``dict.get``: a misplaced or misspelt top-level key is silently ignored
(DeepSpeed #1935). These plain functions refuse such configs, and incompatible settings, before any process
group, JIT build or engine exists.
"""
from __future__ import annotations

import copy
import difflib
import math
from typing import Any, Mapping

import torch

from lit_speed.precision import modes

# Top-level keys DeepSpeed 0.19 reads (deepspeed/runtime/config.py and the feature configs it delegates to).
KNOWN_TOP_LEVEL_KEYS = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer", "scheduler",
    "fp16", "bf16", "bfloat16", "amp", "torch_autocast", "gradient_clipping", "prescale_gradients",
    "gradient_predivide_factor", "gradient_allreduce_op", "sparse_gradients", "zero_optimization",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "activation_checkpointing", "aio",
    "steps_per_print", "wall_clock_breakdown", "dump_state", "flops_profiler", "comms_logger", "tensorboard",
    "wandb", "csv_monitor", "comet", "elasticity", "autotuning", "checkpoint", "data_types", "data_efficiency",
    "curriculum_learning", "compression_training", "communication_data_type",
    "seq_parallel_communication_data_type", "pipeline", "memory_breakdown", "disable_allgather",
    "disable_python_gc", "dataloader_drop_last", "sparse_attention", "weight_quantization", "hybrid_engine",
    "eigenvalue", "progressive_layer_drop", "quantize_training", "tensor_parallel", "nebula",
    "use_node_local_storage", "load_universal_checkpoint", "graph_harvesting", "timers", "compile",
    "managed_gradient_accumulation", "use_data_before_expert_parallelism", "log_level", "mics_shard_size",
})
# Optimizers that can step on CPU-resident (offloaded) state: DeepSpeed's own CPU kernels.
CPU_OFFLOAD_OPTIMIZERS = ("DeepSpeedCPUAdam", "DeepSpeedCPUAdagrad", "DeepSpeedCPULion")
PRECISIONS = modes.DEEPSPEED_MODES  # the Lightning literals DeepSpeedPrecision takes


def _zero_schema() -> dict[str, frozenset[str]]:
    """Allowed keys of ``zero_optimization`` and its offload sections, read from DeepSpeed's pydantic models."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    def keys(model: Any) -> frozenset[str]:
        return frozenset(list(model.model_fields) + [f.alias for f in model.model_fields.values() if f.alias])

    return {"zero_optimization": keys(DeepSpeedZeroConfig),
            "zero_optimization.offload_optimizer": keys(DeepSpeedZeroOffloadOptimizerConfig),
            "zero_optimization.offload_param": keys(DeepSpeedZeroOffloadParamConfig)}


def _check_keys(section: str, given: Mapping[str, Any], allowed: frozenset[str]) -> None:
    for key in given:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), sorted(allowed), n=3)
            hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise ValueError(
                f"ZeroStrategy(config=...): unknown key {key!r} in {section}; DeepSpeed would silently ignore it "
                f"(DeepSpeed #1935).{hint} Allowed keys are listed at https://www.deepspeed.ai/docs/config-json/")


def merge_config(base: Mapping[str, Any], override: Mapping[str, Any] | None) -> dict[str, Any]:
    """Deep-merge ``override`` into a copy of ``base`` (neither argument is modified)."""
    merged = copy.deepcopy(dict(base))
    for key, value in (override or {}).items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge_config(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def validate_config(config: Mapping[str, Any]) -> None:
    """Refuse unknown keys and ZeRO settings that DeepSpeed would ignore or reject late.

    Raises:
        ValueError: On an unknown top-level or ``zero_optimization`` key, a stage outside 1-3, parameter offload
            below stage 3, ``stage3_*`` keys below stage 3, stage 3 with pipeline parallelism or sparse gradients,
            or ``gradient_accumulation_steps`` (set by the Trainer).
    """
    _check_keys("the top level", config, KNOWN_TOP_LEVEL_KEYS)
    if "gradient_accumulation_steps" in config:
        raise ValueError("ZeroStrategy(config=...): do not set 'gradient_accumulation_steps'; it follows "
                         "Trainer(accumulate_grad_batches=N) or an AccumulationScheduler (Hydra: accumulation=fixed|ramp)")
    zero = config.get("zero_optimization", {})
    schema = _zero_schema()
    _check_keys("zero_optimization", zero, schema["zero_optimization"])
    for name in ("offload_optimizer", "offload_param"):
        if isinstance(zero.get(name), Mapping):
            _check_keys(f"zero_optimization.{name}", zero[name], schema[f"zero_optimization.{name}"])
    stage = zero.get("stage", 0)
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeroStrategy(stage={stage!r}): stage must be one of (1, 2, 3), got {stage!r}; for no "
                         "sharding use Trainer(strategy='ddp')")
    if stage < 3:
        if zero.get("offload_param"):
            raise ValueError(f"ZeroStrategy(offload_parameters=True): offload_parameters=True needs stage=3 (ZeRO "
                             f"shards parameters only at stage 3), got stage={stage}; use stage=3 (Hydra: "
                             "strategy=zero3_offload) or set offload_parameters=False")
        stage3_keys = sorted(k for k in zero if str(k).startswith("stage3_"))
        if stage3_keys:
            raise ValueError(f"{stage3_keys} only apply at stage 3, got stage={stage}: DeepSpeed would ignore them; "
                             "remove them or set stage=3")
    if stage == 3 and config.get("pipeline"):
        raise ValueError("stage=3 cannot be combined with DeepSpeed pipeline parallelism ('pipeline' section); "
                         "use stage=1 with pipelines or remove 'pipeline'")
    if stage == 3 and config.get("sparse_gradients"):
        raise ValueError("stage=3 does not support sparse_gradients=true; set sparse_gradients=false or stage<=2")


def _cpu_offload_optimizer_types() -> tuple[type, ...]:
    # importing the classes does not JIT-build their kernels (that happens on construction)
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.ops.lion import DeepSpeedCPULion

    return DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion


def check_zero_optimizer(optimizer: Any) -> None:
    """Refuse an optimizer that declares it cannot step ZeRO's flat partitions (its ``zero_refusal`` says why, e.g.
    the low-bit AdamWs of :mod:`lit_speed.optim.low_bit`), before DeepSpeed builds its engine around it.

    Raises:
        ValueError: Naming the optimizer, its reason and the fix.
    """
    reason = getattr(optimizer, "zero_refusal", None)
    if reason:
        name = type(optimizer).__name__
        raise ValueError(f"ZeroStrategy: {name} cannot train under DeepSpeed ZeRO: {reason}. Fix: strategy=auto or "
                         f"strategy=ddp to keep {name}, or a ZeRO strategy with optimizer=adamw (offload: "
                         "optimizer=cpu_adam)")


def check_offload_optimizer(optimizer: Any, offload: bool) -> None:
    """Refuse CPU offload with an optimizer that cannot step on CPU-resident state.

    Raises:
        ValueError: Naming ``DeepSpeedCPUAdam`` and the Hydra override that selects it.
    """
    name = type(optimizer).__name__
    if offload and not isinstance(optimizer, _cpu_offload_optimizer_types()):
        raise ValueError(
            f"offload_optimizer=True needs an optimizer that runs on CPU ({', '.join(CPU_OFFLOAD_OPTIMIZERS)}), "
            f"got {name}. Use DeepSpeedCPUAdam: Hydra override `optimizer=cpu_adam`, or in Python "
            "`deepspeed.ops.adam.DeepSpeedCPUAdam(params, lr=...)` in configure_optimizers; "
            "or set offload_optimizer=false")


def check_precision(precision: str, accelerator: str | None) -> None:
    """Refuse precisions DeepSpeed cannot run on the given accelerator (``"cpu"``, ``"cuda"``, ...).

    Raises:
        ValueError: For an unknown literal, or fp16 on the CPU accelerator.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS} with ZeroStrategy, got {precision!r}")
    if accelerator == "cpu" and modes.compute_dtype(precision) == torch.float16:
        raise ValueError(f"precision={precision!r} is not supported by DeepSpeed on the CPU accelerator (it refuses "
                         "fp16 there); use precision=bf16-mixed or precision=32-true, or run on a GPU")


def fp16_section(scaler_config: Mapping[str, Any] | None, hysteresis: int = 1) -> dict[str, Any]:
    """DeepSpeed's ``fp16`` section from a GradScaler-style config (init_scale, growth_interval, min_scale, ...).

    DeepSpeed's dynamic scaler grows and backs off by 2: other factors are refused rather than silently changed.
    ``hysteresis=1`` backs off on every overflow, as torch's GradScaler does.

    Raises:
        ValueError: If ``init_scale`` is not a power of two or a factor is not DeepSpeed's fixed 2.
    """
    cfg = dict(scaler_config or {})
    init_scale = float(cfg.get("init_scale", 2.0 ** 16))
    power = math.log2(init_scale) if init_scale > 0 else float("nan")
    if not power.is_integer():
        raise ValueError(f"scaler_config.init_scale must be a power of two with ZeroStrategy (DeepSpeed sets "
                         f"2**initial_scale_power), got {init_scale}")
    if float(cfg.get("growth_factor", 2.0)) != 2.0 or float(cfg.get("backoff_factor", 0.5)) != 0.5:
        raise ValueError(f"scaler_config growth_factor/backoff_factor must be 2.0/0.5 with ZeroStrategy (DeepSpeed's "
                         f"fixed factors), got {cfg.get('growth_factor')}/{cfg.get('backoff_factor')}")
    return {"enabled": True, "loss_scale": 0, "initial_scale_power": int(power),
            "loss_scale_window": int(cfg.get("growth_interval", 1000)), "hysteresis": hysteresis,
            "min_loss_scale": float(cfg.get("min_scale", 1.0))}
