"""Will a Hugging Face fine-tune fit in this machine's RAM? Answered from the config, before any weight is read.

:func:`estimate_run` predicts the process's peak RSS for ``model=hf_causal_lm`` runs
(:mod:`lit_speed.memory.rss_estimate`: the process as it is, exact parameter counts from the architecture built on
the meta device with the run's adapters, the optimizer's declared state, and a scaled probe of one step of the same
architecture at 1-2 layers prepared with the run's levers).
:func:`~lit_speed.run.memory_fit.fit_gate.check_fits_memory` refuses a run that will not fit, naming the cheapest set
of levers that would (:data:`~lit_speed.run.memory_fit.fit_levers.LEVERS`, in order of what they cost in speed), and
``scripts/plan.py`` prints the same estimate for every lever set.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import gc
import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import nn

from lit_speed.optim.state_cost import TORCH_STATES
from lit_speed.run.config_targets import CONFIG_DIR
from lit_speed.run.memory_fit.fit_levers import (
    Levers,
    base_compute,
    batch_positions,
    configured_levers,
    keeps_freed_memory,
    loss_chunk_mib,
)
from lit_speed.strategies.config_facts import config_facts


def hf_folder(cfg: DictConfig) -> Path | None:
    """The local model folder of a ``model=hf_causal_lm`` run (None for other models and hub ids)."""
    if not config_facts(cfg).hf_model:
        return None
    folder = Path(str(cfg.model.get("pretrained"))).expanduser()
    return folder if (folder / "config.json").is_file() else None


#: ``conf/peft/lora.yaml``: the adapters a lever set that adds ``peft=lora`` trains with.
LORA_OPTION = CONFIG_DIR / "peft" / "lora.yaml"
#: The adapters' own keys (others, such as ``export_dir``, may point at ``${hydra:...}``, unset outside a Hydra run).
_ADAPTER_KEYS = ("method", "target_modules", "r", "alpha", "dropout", "trainable_modules", "options")


def _adapter_args(cfg: DictConfig, lora: bool) -> dict[str, Any] | None:
    """``add_adapters``' arguments: the configured ``PEFTAdapters``', else, for a lever set that adds LoRA, those of
    the option ``peft=lora`` selects (:data:`LORA_OPTION`)."""
    peft = config_facts(cfg).adapters
    if peft is None and not lora:
        return None
    peft = peft if peft is not None else OmegaConf.load(LORA_OPTION)
    return {k: OmegaConf.to_container(peft[k], resolve=True) if isinstance(peft[k], (DictConfig, ListConfig))
            else peft[k] for k in _ADAPTER_KEYS if k in peft}


def _prepare(hf: nn.Module, adapters: dict[str, Any] | None, levers: Levers, compute: str = "fp32") -> nn.Module:
    """``hf`` in a holder named as HFCausalLM names it, with the run's adapters and levers (a base computing in
    ``compute``)."""
    from lit_speed.finetune.adapters import add_adapters
    from lit_speed.finetune.frozen_base import lower_frozen_base
    from lit_speed.memory.activation_checkpointing import checkpoint_modules
    from lit_speed.memory.hf_chunked_loss import chunk_hf_loss

    holder = nn.Module()
    holder.model = hf
    if adapters is not None:
        add_adapters(holder, **adapters)
    if (levers.base_bf16 or levers.base_int8) and hf.device.type != "meta":
        lower_frozen_base(holder, torch.int8 if levers.base_int8 else torch.bfloat16, compute=compute)
    if levers.chunked_loss and hf.device.type != "meta":
        chunk_hf_loss(hf, check=False)
    if levers.checkpointing and hf.device.type != "meta":
        checkpoint_modules(holder, ["decoder-layers"])
    holder.train()
    return holder


@dataclass(frozen=True)
class RunFacts:
    """What the estimate needs to know of the run, read once."""

    config: Any
    layers: int
    vocab: int
    tokens: int          # per micro-batch
    block: int
    frozen: int
    trainable: int
    file_bytes: int
    file_dtype_bytes: int
    precision: str
    optimizer: Callable[..., torch.optim.Optimizer] | None
    export_peak: int = 0  # bytes the export of the trained model holds at once (export.export_peak_bytes)


def _text_config(config: Any) -> Any:
    """The language model's part of a Hugging Face config (itself, unless the model is multimodal)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _small(config: Any, layers: int, vocab: int) -> Any:
    small = copy.deepcopy(config)
    text = _text_config(small)
    text.num_hidden_layers, text.vocab_size = layers, vocab
    for key in ("layer_types", "max_window_layers"):  # per-layer lists sized by the layer count
        if isinstance(getattr(text, key, None), list):
            setattr(text, key, getattr(text, key)[:layers])
    return small


def run_facts(cfg: DictConfig, folder: Path, levers: Levers) -> RunFacts:
    import hydra.utils
    from transformers import AutoConfig, AutoModelForCausalLM

    from lit_speed.memory.model_state import parameter_counts

    config = AutoConfig.from_pretrained(folder)
    text = _text_config(config)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    prepared = _prepare(hf, _adapter_args(cfg, levers.lora), levers)
    counts = parameter_counts(prepared)
    frozen, trainable = counts.frozen, counts.trainable
    from lit_speed.finetune.export import export_peak_bytes

    export_peak = export_peak_bytes(prepared.model)
    files = glob.glob(str(folder / "*.safetensors")) + glob.glob(str(folder / "*.bin"))
    dtype = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
    optimizer = hydra.utils.instantiate(cfg.optimizer, _convert_="all") if cfg.get("optimizer") else None
    from lit_speed.precision.modes import AUTO, BASELINE, TABLE

    precision = config_facts(cfg).precision_mode or BASELINE
    if precision == AUTO or precision not in TABLE:  # auto decides at the first batch: float32 is its largest case
        precision = BASELINE
    block = data_window(cfg.data)
    return RunFacts(config, int(text.num_hidden_layers), int(text.vocab_size),
                    batch_positions(cfg, block), block, frozen, trainable,
                    sum(os.path.getsize(f) for f in files), 2 if "16" in dtype else 4, str(precision), optimizer,
                    export_peak)


def data_window(data: DictConfig) -> int:
    """Positions per sequence the data's batches hold at most: ``block_size`` (text windows) or ``max_length``
    (``data=sft``: an example, or a packed row of several, is at most that long)."""
    return int(data.get("block_size") or data.get("max_length"))


#: The probe's longest window: one sequence of the run's block, at most this long (its cost grows with it).
PROBE_MAX_TOKENS = 512


def probe_lengths(config: Any, block: int) -> tuple[int, int]:
    """The probe's two window lengths: half the run's block and the block (at most :data:`PROBE_MAX_TOKENS`, and no
    more than the model's learned positions: an index past them is an IndexError, not a measurement). A step's
    peak is a maximum over time: at a few dozen tokens it sits where the gradients of a large embedding add up, at
    the run's length where the logits are, so the probe measures at the run's length, not at a toy one."""
    text = _text_config(config)
    positions = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    longest = min(block, PROBE_MAX_TOKENS, int(positions) if positions else block)
    return max(longest // 2, 1), max(longest, 2)


#: The generous bound's counts of float32 tensors (4 bytes an element), rounded up so that the bound stays above
#: the probe's estimate: per trainable parameter its gradient, AdamW's two moments and two more for the step's
#: temporaries; per token and decoder layer, tensors of the hidden width (the norms' inputs and outputs, q, k, v, the
#: attention output, the residual sums, and a gradient of each), of the MLP's inner width (gate, up, activation,
#: product, and gradients) and per attention score (scores, probabilities, the gradient); per token, tensors of the
#: vocabulary width (the logits, their float32 copy, the log-softmax, and gradients).
FLOAT32_BYTES = torch.float32.itemsize
TRAINABLE_FLOATS = 1 + 2 + 2
HIDDEN_FLOATS, INNER_FLOATS, SCORE_FLOATS, VOCAB_FLOATS = 20, 6, 3, 6
#: The bound's margin over the sum of its parts.
GENEROUS_MARGIN = 1.5


def generous_bound(facts: RunFacts, process: int) -> int:
    """An upper bound of the peak RSS from the config alone, with no probe: every parameter float32 with a
    gradient and AdamW state, activations at eager attention's widest (scores and probabilities of every head in
    float32), the logits and their gradient several times over (the counts above), all x :data:`GENEROUS_MARGIN`.
    When it fits, the probe is not run (tiny models, small windows); when it does not, :func:`estimate_run`
    measures."""
    text = _text_config(facts.config)
    hidden = int(getattr(text, "hidden_size", 0) or getattr(text, "n_embd", 0) or 4096)
    inner = int(getattr(text, "intermediate_size", 0) or getattr(text, "ffn_dim", 0)
                or getattr(text, "n_inner", 0) or 4 * hidden)
    heads = int(getattr(text, "num_attention_heads", 0) or getattr(text, "n_head", 0) or 32)
    params = facts.frozen + facts.trainable
    state = (params + facts.trainable * TRAINABLE_FLOATS) * FLOAT32_BYTES
    per_layer = hidden * HIDDEN_FLOATS + inner * INNER_FLOATS + heads * facts.block * SCORE_FLOATS
    activations = facts.tokens * (facts.layers * per_layer + facts.vocab * VOCAB_FLOATS) * FLOAT32_BYTES
    return int(process + GENEROUS_MARGIN * max(state + activations, params * FLOAT32_BYTES + facts.file_bytes))


#: The optimizer state assumed where the config's optimizer cannot say (a model's own ``configure_optimizers``, or
#: an optimizer that declares nothing): torch's AdamW, two float32 moments (``lit_speed.optim.state_cost``'s table).
ASSUMED_STATE_BYTES = float(TORCH_STATES[torch.optim.AdamW]({}) * FLOAT32_BYTES)
#: Elements of the float32 parameter a low-bit optimizer's state is measured on (per-element bytes of its codes,
#: block scales and lookup table, which a large tensor spreads over many blocks).
LOW_BIT_SAMPLE = 1 << 20


def optimizer_bytes_per_param(facts: RunFacts, levers: Levers, trainable: list[nn.Parameter]) -> float:
    """Optimizer state bytes per trainable parameter: the low-bit AdamW's a lever set selects, else the configured
    optimizer's declaration (built on one of ``trainable``), else :data:`ASSUMED_STATE_BYTES`."""
    from lit_speed import state_bytes_per_param

    if levers.low_bit_states:
        from lit_speed.optim.low_bit import low_bit_state_bytes

        return low_bit_state_bytes(LOW_BIT_SAMPLE, levers.low_bit_states, low_bit_block_size(levers.low_bit_states),
                                   torch.float32) / LOW_BIT_SAMPLE
    if facts.optimizer is None:
        return ASSUMED_STATE_BYTES
    declared = state_bytes_per_param(facts.optimizer([p for p in trainable][:1] or [nn.Parameter(torch.zeros(1))]))
    return ASSUMED_STATE_BYTES if declared is None else float(declared)


def low_bit_block_size(bits: int) -> int:
    """The block size of ``optimizer=adamw<bits>bit`` (the option a lever set with ``bits``-bit states selects): its
    ``block_size`` in ``conf/optimizer/``, else its class's default."""
    option = OmegaConf.load(CONFIG_DIR / "optimizer" / f"adamw{bits}bit.yaml")
    if option.get("block_size") is not None:
        return int(option.block_size)
    import inspect

    from lit_speed.optim.low_bit import AdamW4bit, AdamW8bit

    return int(inspect.signature(AdamW8bit if bits == 8 else AdamW4bit).parameters["block_size"].default)


def _probe(cfg: DictConfig, facts: RunFacts, levers: Levers, skip_matmuls: bool = True) -> tuple[Any, float, float]:
    """The scaled probe of a step with ``levers``; the optimizer step's temporaries and state, bytes per parameter.
    ``skip_matmuls``: see :func:`~lit_speed.memory.rss_estimate.probe_scaled` (``False``: compute the products)."""
    from transformers import AutoModelForCausalLM

    from lit_speed.memory.model_state import parameter_counts
    from lit_speed.memory.planner import measure_optimizer
    from lit_speed.memory.rss_estimate import probe_scaled
    from lit_speed.precision.modes import autocast_context, spec

    adapters = _adapter_args(cfg, levers.lora)
    compute = base_compute(cfg)
    models: dict[tuple[int, int], nn.Module] = {}

    def build(layers: int, vocab: int) -> nn.Module:
        with _blank_weights():
            small = AutoModelForCausalLM.from_config(_small(facts.config, layers, vocab), dtype=torch.float32)
        small.tie_weights()  # skipped with the initialisation: an untied copy has no summed gradient of the two uses
        with torch.no_grad():  # a constant: the probe measures bytes, and finite values keep every kernel's path
            for parameter in small.parameters():
                parameter.fill_(0.02)
        torch.manual_seed(0)
        prepared = _prepare(small, adapters, levers, compute)
        if layers == 1:  # kept for the optimizer's measurement; the 2-layer copy is freed after its probe
            models[(layers, vocab)] = prepared
        return prepared

    autocast = functools.partial(autocast_context, "cpu", spec(facts.precision).autocast_dtype)
    probe = probe_scaled(build, lambda m, ids: m.model(input_ids=ids, labels=ids).loss, autocast,
                         tokens=probe_lengths(facts.config, facts.block), vocab=facts.vocab,
                         skip_matmuls=skip_matmuls)
    small = models[(1, facts.vocab)]
    small_trainable = parameter_counts(small).trainable
    trainable_params = [p for p in small.parameters() if p.requires_grad]
    step_temp = 0.0
    if facts.optimizer is not None and not levers.low_bit_states and small_trainable:
        measured = measure_optimizer(small, facts.optimizer)
        step_temp = measured.step_bytes / small_trainable
    return probe, step_temp, optimizer_bytes_per_param(facts, levers, trainable_params)


def _blank_weights() -> contextlib.AbstractContextManager:
    """transformers' switch that skips the random initialisation of a model built from its config (``normal_`` over
    a 136M-parameter embedding was a third of plan.py's time); the probe fills in a constant instead."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers < 5
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def export_bytes(cfg: DictConfig, facts: RunFacts, levers: Levers) -> int:
    """Bytes alive at once while the trained model is written after fit (0 without an export): the shard being
    filled and the merged float32 tensor being added (:func:`~lit_speed.finetune.export.export_peak_bytes`, walked
    on the meta-device model). LoRA's merged export unless ``peft.export=false``; full fine-tuning's (``peft=none``:
    ExportModel, ``auto`` writes a Hugging Face model's folder, which these runs are) unless ``peft.export=false``."""
    facts_of_config = config_facts(cfg)
    owner = "adapters" if levers.lora else "model"  # the callback that exports with these levers
    if facts_of_config.exporter == owner and cfg.peft.get("export", True) is False:
        return 0
    return facts.export_peak


def estimate_run(cfg: DictConfig, levers: Levers | None = None, process_bytes: int | None = None,
                 facts: RunFacts | None = None, cache: dict | None = None) -> Any:
    """The predicted peak RSS (:class:`~lit_speed.memory.rss_estimate.RSSEstimate`) of ``cfg`` with ``levers``
    (default: the configured ones), or None when the run is not a local Hugging Face model folder.

    ``process_bytes``: the RSS the process starts from (default: this process's now); 0 asks for the tensors alone,
    without the process and without the probe's own peak (:class:`~lit_speed.memory.rss_estimate.PeakRSS`, which
    the estimate counts otherwise: the probe runs in the run's process before the weights load).

    ``cache`` (a dict kept by the caller across lever sets) keeps the parameter counts per adapter choice and the
    probe per set of levers that change the step's tensors: lever sets that differ only in micro-batch share one
    probe (the step's tensors are linear in tokens), which is what makes ``scripts/plan.py`` one probe per row kind."""
    import psutil

    from lit_speed.memory.allocator import trim_heap
    from lit_speed.memory.rss_estimate import PeakRSS, predict_peak_rss

    folder = hf_folder(cfg)
    if folder is None:
        return None
    configured = configured_levers(cfg)
    levers = levers or configured
    cache = {} if cache is None else cache
    if facts is None:  # given: read for these levers already
        facts = cache.get(("facts", levers.lora)) or run_facts(cfg, folder, levers)
    cache[("facts", levers.lora)] = facts
    process = process_bytes if process_bytes is not None else psutil.Process().memory_info().rss
    key = ("probe", levers.lora, levers.base_bf16, levers.base_int8, levers.chunked_loss, levers.checkpointing,
           levers.low_bit_states)
    if key not in cache:
        with PeakRSS() as seen:
            cache[key] = (*_probe(cfg, facts, levers), seen)
        # the probe's models sit in reference cycles (1B preset: 2.83 GiB alive after the check until the collector's
        # next full pass, 0.52 after one); what they freed then goes back to the system (else glibc's heaps keep it)
        gc.collect()
        trim_heap()
    probe, step_temp, state_bytes, seen = cache[key]
    micro_scale = levers.micro_batch / max(configured.micro_batch, 1)
    tokens = int(facts.tokens * micro_scale)
    return predict_peak_rss(step_extra=_chunk_extra(cfg, facts, levers, tokens) if levers.chunked_loss else 0,
        process=process, frozen_params=facts.frozen, frozen_bytes=frozen_bytes(facts, levers),
        trainable_params=facts.trainable, trainable_bytes=FLOAT32_BYTES, state_bytes_per_param=state_bytes,
        step_temp_per_param=step_temp, probe=probe, layers=facts.layers, vocab=facts.vocab,
        tokens=tokens, load_bytes=read_bytes(facts, levers)
        # int8: the base is quantized after it is read, so its int8 copy adds to what loading holds (1B-dims folder,
        # Z3: 2.49 GB of the folder's file pages + 3.0 GB anonymous at the peak, while quantizing)
        + (facts.frozen if levers.base_int8 else 0), export_bytes=export_bytes(cfg, facts, levers),
        check=seen.peak if process_bytes != 0 else 0, keeps_freed=keeps_freed_memory(cfg))


def frozen_bytes(facts: RunFacts, levers: Levers) -> int:
    """Bytes per frozen parameter: int8 or bf16 base levers, else the precision's module dtype (bf16-true: 2)."""
    from lit_speed.precision.modes import spec

    if levers.base_int8:
        return torch.int8.itemsize
    half = levers.base_bf16 or spec(facts.precision).module_dtype is not None
    return torch.bfloat16.itemsize if half else FLOAT32_BYTES


def read_bytes(facts: RunFacts, levers: Levers) -> int:
    """What ``from_pretrained`` holds while reading the folder (:func:`~lit_speed.memory.rss_estimate.
    load_peak_bytes`): bf16 where a bf16/int8 base is read from a bf16 file, else float32."""
    from lit_speed.memory.rss_estimate import load_peak_bytes

    load_dtype_bytes = 2 if (levers.base_bf16 or levers.base_int8) and facts.file_dtype_bytes == 2 else 4
    return load_peak_bytes(facts.file_bytes, facts.frozen + facts.trainable, load_dtype_bytes, facts.file_dtype_bytes)


def _chunk_extra(cfg: DictConfig, facts: RunFacts, levers: Levers, tokens: int) -> int:
    """Bytes the run's loss chunks hold beyond the probe's (the probe chunks at the default budget): a larger
    configured budget, or ``chunk_mib=auto``'s largest candidate (:func:`~lit_speed.memory.
    chunked_lm_loss_callback.auto_chunk_candidates`)."""
    from lit_speed.memory.chunked_lm_loss import DEFAULT_CHUNK_MIB, bytes_per_logit, chunked_loss_bytes
    from lit_speed.memory.chunked_lm_loss_callback import auto_chunk_candidates
    from lit_speed.precision.modes import spec

    compute = spec(facts.precision).compute_dtype
    text = _text_config(facts.config)
    hidden = int(text.hidden_size)
    mib = loss_chunk_mib(cfg)
    run_bytes = auto_chunk_candidates(facts.vocab, compute)[-1] * facts.vocab * bytes_per_logit(compute) \
        if mib == "auto" else int(float(mib) * 2**20)
    run = chunked_loss_bytes(tokens, facts.vocab, hidden, run_bytes, compute)
    probe = chunked_loss_bytes(tokens, facts.vocab, hidden, DEFAULT_CHUNK_MIB * 2**20, compute)
    return max(0, run - probe)


def describe(estimate: Any) -> str:
    from lit_speed.memory.rss_estimate import gib

    return json.dumps({k: gib(v) for k, v in estimate.parts().items()})
