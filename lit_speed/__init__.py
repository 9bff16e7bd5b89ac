"""lit_speed: PyTorch Lightning components that make training faster and lighter.

Public components are imported lazily, so ``import lit_speed`` stays cheap and a component's heavy
dependencies (DeepSpeed, NVML) load only when that component is used. A component that needs another's
class imports it from here (``from lit_speed import GuardedDeepSpeedPrecision``), never from the other
component's package; see :mod:`lit_speed.interfaces` for the shared modules.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "GuardedPrecision": "lit_speed.precision.guarded_precision",
    "GuardedDeepSpeedPrecision": "lit_speed.precision.zero_guard",
    "AccumulationScheduler": "lit_speed.accumulation.accumulation_scheduler",
    "ZeroStrategy": "lit_speed.strategies.zero_strategy",
    "strategy_facts": "lit_speed.strategies.facts",
    "StrategyFacts": "lit_speed.strategies.facts",
    "config_facts": "lit_speed.strategies.config_facts",
    "ConfigFacts": "lit_speed.strategies.config_facts",
    "check_zero_optimizer": "lit_speed.strategies.zero_config",
    "CurriculumDataModule": "lit_speed.curriculum.curriculum_data_module",
    "CurriculumEarlyStopping": "lit_speed.curriculum.curriculum_early_stopping",
    "DeviceStatsLogger": "lit_speed.monitoring.device_stats_logger",
    "ValidationBudget": "lit_speed.monitoring.validation_budget",
    "MuonAdamW": "lit_speed.optim.muon",
    "ActivationCheckpointing": "lit_speed.memory.activation_checkpointing",
    "activation_checkpointing_on": "lit_speed.memory.activation_checkpointing",
    "ReturnFreedMemory": "lit_speed.memory.allocator",
    "return_freed_memory": "lit_speed.memory.allocator",
    "KeepFreedMemory": "lit_speed.memory.allocator",
    "keep_freed_memory": "lit_speed.memory.allocator",
    "trim_heap": "lit_speed.memory.allocator",
    "head_batch": "lit_speed.accumulation.window",
    "CompileModel": "lit_speed.memory.compile_model",
    "ChunkedLMLoss": "lit_speed.memory.chunked_lm_loss_callback",
    "chunked_lm_loss": "lit_speed.memory.chunked_lm_loss",
    "chunked_loss_bytes": "lit_speed.memory.chunked_lm_loss",
    "chunk_hf_loss": "lit_speed.memory.hf_chunked_loss",
    "unchunk_hf_loss": "lit_speed.memory.hf_chunked_loss",
    "hf_lm_head": "lit_speed.memory.hf_chunked_loss",
    "plan": "lit_speed.memory.planner",
    "RunSummary": "lit_speed.run.summary",
    "AtomicCheckpointIO": "lit_speed.checkpointing.atomic_checkpoint_io",
    "FaultTolerance": "lit_speed.checkpointing.fault_tolerance",
    "DigitsDataModule": "lit_speed.data.digits",
    "CharLMDataModule": "lit_speed.data.charlm",
    "build_corpus": "lit_speed.data.charlm",
    "MLPClassifier": "lit_speed.models.mlp",
    "GPTModule": "lit_speed.models.gpt",
    "Lion": "lit_speed.optim.lion",
    "LowBitAdamW": "lit_speed.optim.low_bit",
    "state_bytes_per_param": "lit_speed.optim.state_cost",
    "state_tensors_per_param": "lit_speed.optim.state_cost",
    "InitWeights": "lit_speed.finetune.init_callback",
    "PEFTAdapters": "lit_speed.finetune.peft_callback",
    "ExportModel": "lit_speed.finetune.export_callback",
    "export_merged": "lit_speed.finetune.export",
    "lower_frozen_base": "lit_speed.finetune.frozen_base",
    "auto_base_dtype": "lit_speed.finetune.base_dtype_choice",
    "choose_base_compute": "lit_speed.finetune.frozen_base",
    "frozen_base_bytes": "lit_speed.finetune.frozen_base",
    "upcast_unlowered": "lit_speed.finetune.frozen_base",
    "set_up_grad": "lit_speed.finetune.adapter_grad",
    "choose_up_grad": "lit_speed.finetune.adapter_grad",
    "load_weights": "lit_speed.finetune.weights",
    "HFCausalLM": "lit_speed.models.hf_causal_lm",
    "TextFolderDataModule": "lit_speed.data.text_folder",
    "load_tokenizer": "lit_speed.data.text_folder",
    "tokenizer_fingerprint": "lit_speed.data.text_folder",
    "ResumableShuffle": "lit_speed.data.resumable",
    "ResumableOrderHooks": "lit_speed.data.resumable",
    "SFTDataModule": "lit_speed.sft.sft_data_module",
    "ResponseSamples": "lit_speed.sft.response_samples",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lit_speed' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
