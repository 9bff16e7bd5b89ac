"""Parameter-efficient fine-tuning (LoRA and other ``peft`` adapters) as a Lightning callback.

Modelled on NeMo 2.0's ``PEFT`` callback: the model is transformed before the optimizer exists, checkpoints hold
the adapters only, and the library (Hugging Face ``peft``) does the math. The functional core is
:mod:`lit_speed.finetune.adapters` and :mod:`lit_speed.finetune.export`.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from typing_extensions import override

from lit_speed import strategy_facts
from lit_speed.finetune.adapter_grad import UP_GRADS, choose_up_grad, set_up_grad
from lit_speed.finetune.adapters import (
    ALL_LINEAR,
    METHODS,
    add_adapters,
    drop_frozen_from_optimizer,
    frozen_fingerprint,
)
from lit_speed.finetune.base_dtype_choice import AUTO, auto_base_dtype
from lit_speed.finetune.export import EXPORT_FORMATS, check_export_dir, check_export_dtype, export_after_fit
from lit_speed.finetune.frozen_base import (
    BASE_DTYPES,
    COMPUTES,
    choose_base_compute,
    lower_frozen_base,
    set_base_compute,
    untimed_base_compute,
    upcast_unlowered,
)
from lit_speed.memory.model_state import ParameterCounts, parameter_counts
from lit_speed.precision.modes import TABLE as PRECISION_MODES
from lit_speed.precision.modes import spec as precision_spec
from lit_speed.tuning import on_rank_zero

ADAPTERS_ONLY_KEY = "adapters_only"  # top-level checkpoint key: the state_dict holds the trainable tensors only


class PEFTAdapters(Callback):
    """Freeze the model, add adapters to the chosen modules, checkpoint the adapters, export the merged model.

    Args:
        method: ``lora`` (default), ``loha``, ``lokr`` (``peft``'s adapters), or ``freeze`` (no adapter: only
            ``trainable_modules`` train, e.g. the head).
        target_modules: Modules that get adapters: names (``qkv``, ``model.blocks.0.attn.qkv``), classes
            (``Linear``, ``LlamaAttention``, an import path), or ``all-linear`` (every Linear but the output head).
        r: Adapter rank.
        alpha: Scale numerator (LoRA scales its update by ``alpha / r``).
        dropout: Dropout on the adapter path.
        trainable_modules: Whole modules that train too (``last-linear`` = the head, or names/classes).
        options: More arguments of the ``peft`` config class (``{use_rslora: true}``, ``{init_weights: gaussian}``).
        adapters_only_checkpoints: Checkpoints hold the trainable tensors only (plus optimizer, loops, and the
            fingerprint of the frozen base they belong to); ``False`` keeps full checkpoints.
        export: After fit, write the merged model into ``export_dir``. Not under ZeRO stage 3
            (parameters are partitioned): refused at setup.
        export_dir: Folder for the export; ``None`` = ``<trainer.default_root_dir>/merged``.
        export_format: ``auto`` (a ``save_pretrained`` folder ``hf/`` for a Hugging Face model, else ``model.pt``),
            ``hf`` or ``state_dict``: one format, written once (see :func:`~lit_speed.finetune.export.export_merged`).
        export_dtype: ``auto`` (the dtype the model's folder declares, else float32), ``float32``, ``bfloat16``
            or ``float16``: the merge is float32, written in this dtype.
        base_dtype: ``bf16`` holds the frozen base's Linear/Embedding weights in bf16 (half their bytes), ``int8``
            in int8 with a float32 scale per output channel (a quarter; the base's values change by at most half a
            quantization step, and the adapters train against the dequantized base), while adapters, gradients and
            optimizer state stay float32 and the merge is float32
            (:mod:`lit_speed.finetune.frozen_base`); ``None`` keeps it as loaded. With float32-weight precision modes
            only (``32-true``, ``bf16-mixed``, ``16-mixed``), not under ZeRO. ``auto``: ``bf16`` where the precision
            mode autocasts every frozen matmul to bf16 anyway (``bf16-mixed``), else as loaded
            (:func:`~lit_speed.finetune.base_dtype_choice.auto_base_dtype`; decided at setup, or by the runner from the
            config before the weights load).
        base_compute: How the bf16/int8 base computes: ``fp32`` (each weight cast for its own matmul), ``bf16`` (native
            bf16 matmuls), or ``auto``: autocast's dtype under a mixed mode, else timed here
            (:func:`~lit_speed.finetune.frozen_base.choose_base_compute`; float32 on CPUs without native bf16).
        up_grad: How LoRA's up-projections (rank -> width) compute their weight gradient: ``standard``
            (``nn.Linear``'s ``dY^T h``), ``transposed`` (``(h^T dY)^T``: the same sums, the rank as the matmul's
            rows; 4-8x faster in MKL on a Zen3 at 0.5B widths), or ``auto``: timed at fit start on the widest
            adapter (:func:`~lit_speed.finetune.adapter_grad.choose_up_grad`, cached per machine), kept on resume.

    Raises:
        ValueError: An unknown method, a rank < 1, targets that match nothing (listing the module names and classes
            that exist), export under ZeRO-3, or a resume onto other base weights than the checkpoint's.

    Example::

        trainer = Trainer(callbacks=[PEFTAdapters("lora", target_modules=["qkv", "fc"], r=8)])
    """

    def __init__(self, method: str = "lora", target_modules: Sequence[str] = (ALL_LINEAR,), r: int = 8,
                 alpha: float = 16.0, dropout: float = 0.0, trainable_modules: Sequence[str] = (),
                 options: dict[str, Any] | None = None, adapters_only_checkpoints: bool = True, export: bool = True,
                 export_dir: str | None = None, export_format: str = "auto", base_dtype: str | None = None,
                 base_compute: str = "auto", up_grad: str = "auto", export_dtype: str = "auto") -> None:
        if method not in METHODS:
            raise ValueError(f"PEFTAdapters(method={method!r}): unknown method. "
                             f"Fix: method=<one of {', '.join(METHODS)}>")
        if isinstance(target_modules, str):
            target_modules = [target_modules]
        if isinstance(trainable_modules, str):
            trainable_modules = [trainable_modules]
        if method != "freeze" and (isinstance(r, bool) or not isinstance(r, int) or r < 1):
            raise ValueError(f"PEFTAdapters(r={r!r}): the adapter rank must be an int >= 1. Fix: r=8 (4-64 is usual)")
        if export_format not in EXPORT_FORMATS:
            raise ValueError(f"PEFTAdapters(export_format={export_format!r}): must be one of "
                             f"{', '.join(EXPORT_FORMATS)}. Fix: export_format=auto (hf/ for a Hugging Face model, "
                             "else model.pt)")
        if method != "freeze" and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
                                   or not math.isfinite(alpha) or alpha <= 0):
            raise ValueError(f"PEFTAdapters(alpha={alpha!r}): LoRA scales its update by alpha / r, so alpha must be a "
                             "number > 0 (a negative one turns the update around, 0 switches it off). Fix: alpha=16 "
                             "(2 x r is usual)")
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"PEFTAdapters(dropout={dropout!r}): must be in [0, 1). Fix: dropout=0.05")
        self.method, self.r, self.alpha, self.dropout = method, r, float(alpha), float(dropout)
        self.target_modules = list(target_modules)
        self.trainable_modules = list(trainable_modules)
        self.options = dict(options or {})
        self.adapters_only_checkpoints = bool(adapters_only_checkpoints)
        self.export, self.export_dir, self.export_format = bool(export), export_dir, export_format
        self.export_dtype = check_export_dtype("PEFTAdapters", export_dtype)
        self.export_seconds: float | None = None
        if base_dtype is not None and base_dtype not in (*BASE_DTYPES, AUTO):
            raise ValueError(f"PEFTAdapters(base_dtype={base_dtype!r}): the frozen base is held in one of "
                             f"{', '.join(BASE_DTYPES)} or as loaded (null), or {AUTO} decides. Fix: base_dtype=bf16, "
                             "or base_dtype=auto")
        if base_compute not in COMPUTES:
            raise ValueError(f"PEFTAdapters(base_compute={base_compute!r}): one of {', '.join(COMPUTES)}. "
                             "Fix: base_compute=auto")
        if base_dtype not in (None, AUTO) and method == "freeze":
            raise ValueError(f"PEFTAdapters(base_dtype={base_dtype!r}): method=freeze has no adapters; a frozen "
                             "model with a low-precision base is what precision=bf16-true gives. Fix: method=lora, "
                             "or base_dtype=null")
        if up_grad not in UP_GRADS:
            raise ValueError(f"PEFTAdapters(up_grad={up_grad!r}): one of {', '.join(UP_GRADS)}. Fix: up_grad=auto "
                             "(timed here at fit start)")
        # base_dtype: how the frozen base is held (None: as loaded); with auto, decided by decide_base_dtype
        self.base_dtype_setting, self.base_compute = base_dtype, base_compute
        self.base_dtype: str | None = None if base_dtype == AUTO else base_dtype
        self.base_dtype_reason = "" if base_dtype == AUTO else "requested"
        self.up_grad = up_grad
        self.chosen_up_grad: str | None = None  # standard / transposed, decided at fit start, kept in checkpoints
        self.up_grad_reason = ""
        self.chosen_compute: str | None = None  # base_compute decided (fp32 / bf16), kept in checkpoints
        self.compute_reason = ""
        self.lowered: Any = None
        self.targets: list[str] = []
        self.trainable_names: list[str] = []
        self.counts: ParameterCounts | None = None
        self.base_fingerprint: str | None = None
        self.exported: dict[str, str] = {}
        self.dropped_from_optimizer = 0

    # ---- transform ----------------------------------------------------------------------------------------

    def decide_base_dtype(self, precision_mode: str | None, zero: bool = False) -> str | None:
        """With ``base_dtype=auto``, decide it once for ``precision_mode`` (:func:`auto_base_dtype`); returns how the
        base is held. The runner decides from the config before the weights load; alone, :meth:`setup` does."""
        if self.base_dtype_setting == AUTO and not self.base_dtype_reason:
            self.base_dtype, reason = auto_base_dtype(precision_mode, zero, self.method)
            self.base_dtype_reason = f"auto: {reason}"
        return self.base_dtype

    def prepare_model(self, model: nn.Module) -> None:
        """Add the adapters to ``model`` and freeze the rest (once; the runner calls it before the start-up table)."""
        if self.counts is not None:
            return
        if self.base_dtype_setting == AUTO and not self.base_dtype_reason:  # before any Trainer: nothing to decide by
            self.base_dtype_reason = "auto: prepared before a Trainer, the precision is not known: as loaded"
        self.targets = add_adapters(model, self.method, self.target_modules, self.r, self.alpha, self.dropout,
                                    self.trainable_modules, self.options)
        self.trainable_names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.counts = parameter_counts(model)
        self.base_fingerprint = frozen_fingerprint(model)  # of the base as loaded: the same with any base_dtype
        if self.base_dtype is not None:
            compute = self.base_compute if self.base_compute != "auto" else "fp32"  # auto: decided at fit start
            self.lowered = lower_frozen_base(model, BASE_DTYPES[self.base_dtype], compute)
        if getattr(model, "loaded_low_precision", False):  # HFCausalLM(load_dtype=bf16): the rest back to float32
            upcast_unlowered(model)
        if self.adapters_only_checkpoints and isinstance(model, pl.LightningModule):
            # the checkpoint lacks the frozen base by design; on_load_checkpoint checks what must be there
            model.strict_loading = False
        trainable, total = self.counts.trainable, self.counts.total
        rank_zero_info(f"PEFTAdapters: {self.method} on {len(self.targets)} modules; {trainable:,} of {total:,} "
                       f"parameters train ({100 * trainable / max(total, 1):.2f}%)")

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self.decide_base_dtype(_precision_mode(trainer), strategy_facts(trainer.strategy).zero_stage is not None)
        self.prepare_model(pl_module)
        stage3 = strategy_facts(trainer.strategy).zero_stage == 3
        if self.export and stage3 and stage == "fit":
            raise ValueError("PEFTAdapters(export=True): cannot merge and export under ZeRO stage 3 (each process "
                             "holds a slice of every weight). Fix: peft.export=false, then scripts/consolidate.py "
                             "and lit_speed.finetune.export_merged on the consolidated model; or strategy=zero2")
        if self.base_dtype is not None:
            self._check_base_dtype(trainer)
        if self.export and stage == "fit" and trainer.is_global_zero:  # rank 0 exports: fail now, not after training
            check_export_dir(self._export_folder(trainer))
        if self.adapters_only_checkpoints and hasattr(trainer.strategy, "exclude_frozen_parameters"):
            trainer.strategy.exclude_frozen_parameters = True  # DeepSpeed writes the module itself: adapters only

    def _check_base_dtype(self, trainer: "pl.Trainer") -> None:
        """A low-precision base needs float32 module weights around it (adapters in float32) and no ZeRO."""
        mode = _precision_mode(trainer)
        if mode == "auto":
            raise ValueError(f"PEFTAdapters(base_dtype={self.base_dtype}): precision=auto may choose bf16-master, "
                             "which casts the adapters to bf16 too. Fix: precision=32-true or bf16-mixed (the base's "
                             "compute is chosen by peft.base_compute=auto), or base_dtype=null")
        found = precision_spec(mode)
        if found.weight_dtype != torch.float32:
            raise ValueError(f"PEFTAdapters(base_dtype={self.base_dtype}): precision={mode} casts the whole module, "
                             "adapters included, to bf16 (the base is then bf16 already, and adapters not float32). "
                             "Fix: precision=32-true or bf16-mixed with base_dtype=bf16, or base_dtype=null")
        if strategy_facts(trainer.strategy).zero_stage is not None:
            raise ValueError(f"PEFTAdapters(base_dtype={self.base_dtype}): DeepSpeed ZeRO casts and partitions the "
                             "module's parameters itself, so a bf16 base under float32 adapters is not kept. Fix: "
                             "strategy=auto or ddp with base_dtype=bf16, or base_dtype=null under ZeRO")

    def _decide_base_compute(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.chosen_compute is None:  # not restored from a checkpoint
            untimed = untimed_base_compute(self.base_compute, precision_spec(str(trainer.precision)).autocast_dtype)
            if untimed is not None:
                self.chosen_compute, self.compute_reason = untimed
            else:
                decision = on_rank_zero(lambda: choose_base_compute(pl_module, trainer.strategy.root_device), trainer)
                self.chosen_compute, self.compute_reason = decision.chosen, decision.reason
            rank_zero_info(f"PEFTAdapters: frozen base in {self.base_dtype}, computed in {self.chosen_compute} "
                           f"({self.compute_reason})")
        set_base_compute(pl_module, self.chosen_compute)

    def _decide_up_grad(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        stage3 = strategy_facts(trainer.strategy).zero_stage == 3
        if self.chosen_up_grad is None:  # not restored from a checkpoint
            if self.up_grad != "auto":
                self.chosen_up_grad, self.up_grad_reason = self.up_grad, "requested"
            elif stage3:
                self.chosen_up_grad = "standard"
                self.up_grad_reason = "ZeRO stage 3 gathers partitioned weights through its own F.linear: not timed"
            else:
                decision = on_rank_zero(lambda: choose_up_grad(pl_module, trainer.strategy.root_device,
                                                               _tokens_per_batch(trainer), _compute_dtype(trainer)),
                                        trainer)  # rank 0 decides for every process
                self.chosen_up_grad, self.up_grad_reason = decision.chosen, decision.reason
        if self.chosen_up_grad == "transposed" and stage3:
            raise ValueError("PEFTAdapters(up_grad=transposed): not under ZeRO stage 3 (it gathers partitioned weights "
                             "through its own F.linear autograd function). Fix: up_grad=auto, or strategy=zero2")
        modules = set_up_grad(pl_module, self.chosen_up_grad)
        if modules:
            rank_zero_info(f"PEFTAdapters: {modules} LoRA up-projections compute their weight gradient "
                           f"{self.chosen_up_grad} ({self.up_grad_reason})")

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.base_dtype is not None:  # after a resume restored the checkpoint's choice
            self._decide_base_compute(trainer, pl_module)
        self._decide_up_grad(trainer, pl_module)
        if strategy_facts(trainer.strategy).zero_stage is not None:
            return  # DeepSpeed's ZeRO optimizer keeps only parameters that require gradients
        # before restore_training_state: a resumed optimizer loads into the same (pruned) groups
        fresh = [opt for opt in trainer.optimizers if not opt.state]
        self.dropped_from_optimizer = sum(drop_frozen_from_optimizer(opt) for opt in fresh)

    # ---- checkpoints --------------------------------------------------------------------------------------

    @override
    def on_save_checkpoint(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           checkpoint: dict[str, Any]) -> None:
        if not self.adapters_only_checkpoints:
            return
        checkpoint[ADAPTERS_ONLY_KEY] = True
        if "state_dict" in checkpoint:
            keep = set(self.trainable_names)
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in keep}

    @override
    def on_load_checkpoint(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("state_dict")
        if not checkpoint.get(ADAPTERS_ONLY_KEY) or saved is None:
            return
        missing = [n for n in self.trainable_names if n not in saved]
        if missing:
            raise ValueError(f"PEFTAdapters: the checkpoint lacks {len(missing)} of this run's "
                             f"{len(self.trainable_names)} trainable tensors (the first is {missing[0]}): it was "
                             "written with other peft.* settings. "
                             "Fix: the peft.method/target_modules/r of the run that wrote it, or ckpt_path=null")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"base_fingerprint": self.base_fingerprint, "method": self.method, "targets": len(self.targets),
                "trainable_tensors": len(self.trainable_names), "base_dtype": self.base_dtype,
                "base_compute": self.chosen_compute, "up_grad": self.chosen_up_grad}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("base_fingerprint")
        if saved is not None and self.base_fingerprint is not None and saved != self.base_fingerprint:
            raise ValueError(f"PEFTAdapters: the checkpoint's adapters were trained on other base weights (frozen "
                             f"tensors' fingerprint {saved} there, {self.base_fingerprint} here): resuming would not "
                             "continue the same run. Fix: the init.path / model.pretrained of the run that wrote it")
        if state_dict.get("base_dtype") != self.base_dtype:
            raise ValueError(f"PEFTAdapters(base_dtype={self.base_dtype}): the checkpoint's adapters were trained over "
                             f"a base held in {state_dict.get('base_dtype') or 'its loaded dtype'}: resuming would not "
                             f"continue the same run. Fix: base_dtype={state_dict.get('base_dtype') or 'null'}")
        if self.base_dtype is not None and state_dict.get("base_compute"):
            self.chosen_compute = state_dict["base_compute"]  # the same numerics as before the interruption
            self.compute_reason = "restored from the checkpoint (not timed again)"
        if state_dict.get("up_grad") and self.up_grad == "auto":  # the same kernels as before the interruption
            self.chosen_up_grad, self.up_grad_reason = state_dict["up_grad"], "restored from the checkpoint"

    # ---- export -------------------------------------------------------------------------------------------

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.export and not trainer.interrupted:
            self._export(trainer, pl_module)

    def _export(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        written = export_after_fit(trainer, pl_module, self._export_folder(trainer), self.export_format,
                                   label="PEFTAdapters: merged model", dtype=self.export_dtype)
        if written is not None:  # rank 0
            self.exported, self.export_seconds = written

    def _export_folder(self, trainer: "pl.Trainer") -> Path:
        return Path(self.export_dir) if self.export_dir else Path(trainer.default_root_dir) / "merged"

    # ---- reports ------------------------------------------------------------------------------------------

    def describe(self) -> dict[str, str]:
        what = (f"{self.method} r={self.r} alpha={self.alpha:g} on {len(self.targets)} modules"
                if self.method != "freeze" else "no adapters (freeze)")
        if self.trainable_modules:
            what += f", + trainable {', '.join(map(str, self.trainable_modules))}"
        rows = {"peft": what + (", adapters-only checkpoints" if self.adapters_only_checkpoints else "")}
        if self.base_dtype is not None:
            held = (f"{self.lowered.tensors} tensors, {self.lowered.saved_bytes / 2**20:,.1f} MiB saved"
                    if self.lowered is not None else "lowered when adapters are added")
            if self.lowered is not None and not self.lowered.tensors and self.lowered.modules:  # a bf16 folder
                held = f"{len(self.lowered.modules)} modules, read from the folder in {self.base_dtype}: nothing cast"
            compute = (f"{self.chosen_compute} ({self.compute_reason})" if self.chosen_compute else
                       f"{self.base_compute}" + (" (decided at fit start)" if self.base_compute == "auto" else ""))
            rows["frozen base"] = f"held in {self.base_dtype} ({held}); computed in {compute}"
            if self.base_dtype_setting == AUTO:
                rows["frozen base"] += f"; {self.base_dtype_reason}"
        elif self.base_dtype_setting == AUTO and self.method != "freeze":
            rows["frozen base"] = f"as loaded ({self.base_dtype_reason or 'auto: decided at setup'})"
        if self.method == "lora":
            rows["adapter gradients"] = (f"up-projections {self.chosen_up_grad} ({self.up_grad_reason})"
                                         if self.chosen_up_grad else f"up-projections {self.up_grad}"
                                         + (" (decided at fit start)" if self.up_grad == "auto" else ""))
        if self.counts is not None:
            trainable, total = self.counts.trainable, self.counts.total
            rows["trainable parameters"] = (f"{trainable:,} of {total:,} ({100 * trainable / max(total, 1):.2f}%), "
                                            f"{total - trainable:,} frozen")
        return rows

    def phase_seconds(self) -> dict[str, float]:
        """``{"export": seconds}`` of the merged export (lit_speed.run_contract.PhaseTimer)."""
        return {"export": self.export_seconds or 0.0}

    def final_summary(self) -> dict[str, Any]:
        trainable, total = (self.counts.trainable, self.counts.total) if self.counts is not None else (0, 0)
        return {"method": self.method, "target_modules": len(self.targets), "trainable_params": trainable,
                "total_params": total, "base_fingerprint": self.base_fingerprint, "exported": self.exported,
                "export_s": self.export_seconds, "frozen_dropped_from_optimizer": self.dropped_from_optimizer,
                "base_dtype": self.base_dtype, "base_compute": self.chosen_compute, "up_grad": self.chosen_up_grad,
                "base_bytes_saved": self.lowered.saved_bytes if self.lowered is not None else 0}


def _tokens_per_batch(trainer: "pl.Trainer", default: int = 2048) -> int:
    """Tokens per micro-batch of the run's data (``batch_size x block_size`` of its DataModule), else ``default``."""
    data = trainer.datamodule
    sizes = [getattr(data, key, None) or getattr(getattr(data, "hparams", {}), "get", lambda _k: None)(key)
             for key in ("batch_size", "block_size")]
    return sizes[0] * sizes[1] if all(isinstance(v, int) and v > 0 for v in sizes) else default


def _precision_mode(trainer: "pl.Trainer") -> str:
    """The precision mode the run asked for (lit_speed's plugin keeps ``auto`` as ``requested_mode``)."""
    plugin = trainer.precision_plugin
    return str(getattr(plugin, "requested_mode", None) or getattr(plugin, "precision", trainer.precision))


def _compute_dtype(trainer: "pl.Trainer") -> torch.dtype:
    """The dtype the adapters' matmuls run in under the run's precision (float32 for ``auto``, its largest case)."""
    mode = _precision_mode(trainer)
    return precision_spec(mode).compute_dtype if mode in PRECISION_MODES else torch.float32
