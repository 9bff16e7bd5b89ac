"""A Hugging Face causal language model (``AutoModelForCausalLM``) as a LightningModule.

``python scripts/train.py model=hf_causal_lm data=text_folder model.pretrained=<folder or hub id> data.root=<texts>``

The model trains on the same ``(input, target)`` token windows as the bundled GPT, so every lit_speed component
applies unchanged: precision modes, accumulation (token-normalised too), ZeRO, activation checkpointing by block
class (``LlamaDecoderLayer``, ``GPT2Block``), device stats, fault tolerance, adapters (``peft=lora``).
Needs the ``finetune`` extra (``pip install -e ".[finetune]"``: transformers, peft, safetensors).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import lightning.pytorch as pl
import torch

import lit_speed  # the public names: hf_lm_head (lit_speed.memory)
from lit_speed.models.next_token import NextTokenSteps
from lit_speed.run_contract import TokenLimits

# config keys of computed (rotary) positions, and model types with a learned table of max_position_embeddings rows
ROTARY_KEYS = ("rope_parameters", "rope_scaling", "rope_theta", "rotary_pct", "rotary_dim")
LEARNED_POSITIONS = ("gpt2", "opt", "gpt_bigcode", "biogpt")


def _needs_transformers(owner: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise ValueError(f"{owner}: needs the transformers package. Fix: pip install -e \".[finetune]\" "
                         "(or bash scripts/run.sh setup)") from None
    return transformers


def _load_dtype(pretrained: str, load_dtype: str | None, owner: str) -> torch.dtype:
    """float32, or bf16 when asked (``load_dtype=bf16``, set by ``peft.base_dtype=bf16``; ``int8`` asks the same: the
    base is quantized after loading) and the folder's weights are bf16: read as they are stored, nothing is rounded."""
    if load_dtype in (None, "float32", "fp32", "auto"):  # auto: peft.base_dtype=auto where no runner decided it
        return torch.float32
    if load_dtype == "int8":  # peft.base_dtype=int8: quantized after loading, from the folder's own values
        load_dtype = "bf16"
    if load_dtype not in ("bf16", "bfloat16"):
        raise ValueError(f"{owner}: load_dtype={load_dtype!r} is not one of float32, bf16, int8. Fix: "
                         "model.load_dtype=null "
                         "(float32), or peft.base_dtype=bf16 (which reads a bf16 folder in bf16)")
    config = Path(pretrained).expanduser() / "config.json"
    if not config.is_file():
        return torch.float32
    import json

    fields = json.loads(config.read_text())
    stored = fields.get("dtype") or fields.get("torch_dtype")
    return torch.bfloat16 if stored == "bfloat16" else torch.float32


class HFCausalLM(NextTokenSteps, pl.LightningModule):
    """Next-token training of any ``AutoModelForCausalLM``.

    Args:
        pretrained: A ``save_pretrained`` folder or a hub id (downloaded by ``transformers``: needs network).
        from_config: Build the architecture of ``pretrained`` with fresh random weights instead of its weights.
        optimizer: Factory ``params -> Optimizer`` (a Hydra ``_partial_``).
        scheduler: Optional factory ``(optimizer, total_steps) -> LRScheduler``.
        weight_decay: On matrices and embeddings only (0 is usual for fine-tuning).
        attn_implementation: ``sdpa`` (default), ``eager``, or what ``transformers`` offers for the model.
        loss_chunk_mib: Run the LM head and the loss in chunks of at most this many MiB of logits (the decoder's
            hidden states go to ``lit_speed.chunked_lm_loss``; ``lm_head`` never sees all tokens); ``None``: the
            plain loss. ``lit_speed.ChunkedLMLoss`` sets it too.

    Raises:
        ValueError: ``pretrained`` is neither a model folder nor a hub id that can be fetched.

    Example::

        model = HFCausalLM("path/to/folder", optimizer=functools.partial(torch.optim.AdamW, lr=1e-4))
    """

    # lit_speed.run_contract.BatchConsumer: (input, target) windows of a text folder, or token dicts (data=sft)
    accepted_batch_kinds = ("tokenizer-ids->next-token", "token-dict->next-token")

    def __init__(self, pretrained: str, from_config: bool = False,
                 optimizer: Callable[..., torch.optim.Optimizer] | None = None,
                 scheduler: Callable[..., Any] | None = None, weight_decay: float = 0.0,
                 attn_implementation: str | None = "sdpa", loss_chunk_mib: float | None = None,
                 load_dtype: str | None = None) -> None:
        super().__init__()
        owner = f"HFCausalLM(pretrained={pretrained})"
        transformers = _needs_transformers(owner)
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
        try:
            if from_config:
                config = transformers.AutoConfig.from_pretrained(pretrained)
                # float32 as from_pretrained below: from_config builds in the config's dtype (bf16 for most released
                # models), whose matmuls are 50-500x slower on CPUs without bf16 kernels
                self.model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs)
            else:  # float32 weights: the precision plugin decides the compute dtype
                dtype = _load_dtype(pretrained, load_dtype, owner)
                self.model = transformers.AutoModelForCausalLM.from_pretrained(pretrained, dtype=dtype, **kwargs)
                # read in bf16 for a bf16 frozen base (no float32 copy of the whole model while loading): PEFTAdapters
                # lowers the frozen weights and casts the rest back to float32 (setup() does, without adapters)
                self.loaded_low_precision = dtype != torch.float32
        except (OSError, ValueError) as error:
            where = "a folder without a model" if Path(pretrained).expanduser().is_dir() else \
                "not a local folder, and not fetched from the hub (offline, or no such id)"
            raise ValueError(f"{owner}: {where} ({' '.join(str(error).split())[:200]}). Fix: model.pretrained=<a "
                             "save_pretrained folder>, or a hub id with network access") from None
        # from_pretrained hands the model back in eval mode and Lightning keeps module modes (it only restores them
        # around validation): without this the model would train with its dropout silently off
        self.model.train()
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self._lm_head: Any = None  # lit_speed.hf_lm_head(self.model), found when the chunked loss is switched on
        if loss_chunk_mib is not None:
            self.use_chunked_loss(int(float(loss_chunk_mib) * 2**20))

    def setup(self, stage: str) -> None:
        # after the callbacks' setup (PEFTAdapters lowers the frozen base there): whatever is still bf16 from a
        # bf16 read becomes float32, as from_pretrained(dtype=float32) would have made it
        if getattr(self, "loaded_low_precision", False):
            lit_speed.upcast_unlowered(self)

    def forward(self, idx: torch.Tensor, **model_kwargs: torch.Tensor) -> torch.Tensor:
        """Logits of ``idx``; ``model_kwargs``: ``position_ids`` (packed rows) or ``attention_mask``."""
        return self.model(input_ids=idx, use_cache=False, **model_kwargs).logits

    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int, stop_ids: list[int], pad_id: int) -> list[int]:
        """Greedy continuation of ``prompt_ids`` (``transformers``' ``generate`` with its KV cache), up to
        ``max_new_tokens`` or a token of ``stop_ids`` (which is returned last)."""
        from transformers import GenerationConfig

        ids = torch.tensor([prompt_ids], device=self.device)
        config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(stop_ids),
                                  pad_token_id=pad_id)
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
        return out[0, ids.shape[1]:].tolist()

    def use_chunked_loss(self, chunk_bytes: int | None) -> None:
        if chunk_bytes is not None and self._lm_head is None:  # checked on a probe: refused if logits are more
            self._lm_head = lit_speed.hf_lm_head(self.model, owner=f"{type(self).__name__}(loss_chunk_mib=...)")
        super().use_chunked_loss(chunk_bytes)

    def head_inputs(self, idx: torch.Tensor, **model_kwargs: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict[str, Any]]:
        spec = self._lm_head
        if spec is None or spec.head is not self.model.get_output_embeddings():  # e.g. adapters put on the head
            spec = self._lm_head = lit_speed.hf_lm_head(self.model, owner=f"{type(self).__name__}(loss_chunk_mib=...)")
        hidden = spec.decoder(input_ids=idx, use_cache=False, **model_kwargs)[0]
        scale = getattr(spec.head, "held_weight_scale", None)  # an int8-held head (peft.base_dtype=int8)
        return hidden, spec.head.weight, spec.head.bias, {**spec.loss_options(), **({} if scale is None else
                                                                                    {"weight_scale": scale})}

    @classmethod
    def input_limits(cls, config: Mapping[str, Any]) -> TokenLimits | None:
        """Embedding rows and positions read from ``config.json`` alone, before any weight loads
        (``lit_speed.run_contract.TokenModel``); ``None`` when the config cannot be read (building the model says why).
        """
        pretrained = config.get("pretrained")
        try:
            import transformers

            hf = transformers.AutoConfig.from_pretrained(pretrained)
        except Exception:  # noqa: BLE001 - no transformers, an offline hub id, no folder: the model's build names it
            return None
        text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
        vocab, positions = getattr(text, "vocab_size", None), getattr(text, "max_position_embeddings", None)
        if not isinstance(vocab, int):
            return None
        rotary = any(getattr(text, key, None) is not None for key in ROTARY_KEYS)
        kind = "rotary" if rotary else "learned" if getattr(text, "model_type", "") in LEARNED_POSITIONS else ""
        name = (getattr(hf, "architectures", None) or [type(hf).__name__.removesuffix("Config")])[0]
        return TokenLimits(vocab, positions if isinstance(positions, int) else None, f"pretrained={pretrained}", kind,
                           name)
