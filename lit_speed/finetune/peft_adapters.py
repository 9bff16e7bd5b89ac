"""Parameter-efficient fine-tuning (LoRA and other ``peft`` adapters) as a Lightning callback.

Modelled on NeMo 2.0's ``PEFT`` callback: the model is transformed before the optimizer exists, checkpoints hold
the adapters only, and the library (Hugging Face ``peft``) does the math. The functional core is
:mod:`lit_speed.finetune.adapters` and :mod:`lit_speed.finetune.export`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from torch import nn
from typing_extensions import override

from lit_speed.finetune.adapters import (ALL_LINEAR, METHODS, add_adapters, drop_frozen_from_optimizer,
                                         frozen_fingerprint, parameter_counts)
from lit_speed.finetune.export import check_export_dir, export_merged

ADAPTERS_ONLY_KEY = "adapters_only"  # top-level checkpoint key: the state_dict holds the trainable tensors only


def _zero_stage(strategy: Any) -> int | None:
    config = getattr(strategy, "config", None)
    if not isinstance(config, dict) or "zero_optimization" not in config:
        return None
    return int(config["zero_optimization"].get("stage", 0))


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
        export: After fit, write the merged model into ``export_dir`` (``model.pt``, and ``hf/`` for a Hugging Face
            model). Not under ZeRO stage 3 (parameters are partitioned): refused at setup.
        export_dir: Folder for the export; ``None`` = ``<trainer.default_root_dir>/merged``.

    Raises:
        ValueError: An unknown method, a rank < 1, targets that match nothing (listing the module names and classes
            that exist), export under ZeRO-3, or a resume onto other base weights than the checkpoint's.

    Example::

        trainer = Trainer(callbacks=[PEFTAdapters("lora", target_modules=["qkv", "fc"], r=8)])
    """

    def __init__(self, method: str = "lora", target_modules: Sequence[str] = (ALL_LINEAR,), r: int = 8,
                 alpha: float = 16.0, dropout: float = 0.0, trainable_modules: Sequence[str] = (),
                 options: dict[str, Any] | None = None, adapters_only_checkpoints: bool = True, export: bool = True,
                 export_dir: str | None = None) -> None:
        if method not in METHODS:
            raise ValueError(f"PEFTAdapters(method={method!r}): unknown method. "
                             f"Fix: method=<one of {', '.join(METHODS)}>")
        if isinstance(target_modules, str):
            target_modules = [target_modules]
        if isinstance(trainable_modules, str):
            trainable_modules = [trainable_modules]
        if method != "freeze" and (isinstance(r, bool) or not isinstance(r, int) or r < 1):
            raise ValueError(f"PEFTAdapters(r={r!r}): the adapter rank must be an int >= 1. Fix: r=8 (4-64 is usual)")
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"PEFTAdapters(dropout={dropout!r}): must be in [0, 1). Fix: dropout=0.05")
        self.method, self.r, self.alpha, self.dropout = method, r, float(alpha), float(dropout)
        self.target_modules = list(target_modules)
        self.trainable_modules = list(trainable_modules)
        self.options = dict(options or {})
        self.adapters_only_checkpoints = bool(adapters_only_checkpoints)
        self.export, self.export_dir = bool(export), export_dir
        self.targets: list[str] = []
        self.trainable_names: list[str] = []
        self.counts: tuple[int, int] | None = None
        self.base_fingerprint: str | None = None
        self.exported: dict[str, str] = {}
        self.dropped_from_optimizer = 0

    # ---- transform ----------------------------------------------------------------------------------------

    def prepare_model(self, model: nn.Module) -> None:
        """Add the adapters to ``model`` and freeze the rest (once; the runner calls it before the start-up table)."""
        if self.counts is not None:
            return
        self.targets = add_adapters(model, self.method, self.target_modules, self.r, self.alpha, self.dropout,
                                    self.trainable_modules, self.options)
        self.trainable_names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.counts = parameter_counts(model)
        self.base_fingerprint = frozen_fingerprint(model)
        if self.adapters_only_checkpoints and isinstance(model, pl.LightningModule):
            # the checkpoint lacks the frozen base by design; on_load_checkpoint checks what must be there
            model.strict_loading = False
        trainable, total = self.counts
        rank_zero_info(f"PEFTAdapters: {self.method} on {len(self.targets)} modules; {trainable:,} of {total:,} "
                       f"parameters train ({100 * trainable / max(total, 1):.2f}%)")

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self.prepare_model(pl_module)
        stage3 = _zero_stage(trainer.strategy) == 3
        if self.export and stage3 and stage == "fit":
            raise ValueError("PEFTAdapters(export=True): cannot merge and export under ZeRO stage 3 (each process "
                             "holds a slice of every weight). Fix: peft.export=false, then scripts/consolidate.py "
                             "and lit_speed.finetune.export_merged on the consolidated model; or strategy=zero2")
        if self.export and stage == "fit" and trainer.is_global_zero:  # rank 0 exports: fail now, not after training
            check_export_dir(self._export_folder(trainer))
        if self.adapters_only_checkpoints and hasattr(trainer.strategy, "exclude_frozen_parameters"):
            trainer.strategy.exclude_frozen_parameters = True  # DeepSpeed writes the module itself: adapters only

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if _zero_stage(trainer.strategy) is not None:
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
                "trainable_tensors": len(self.trainable_names)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("base_fingerprint")
        if saved is not None and self.base_fingerprint is not None and saved != self.base_fingerprint:
            raise ValueError(f"PEFTAdapters: the checkpoint's adapters were trained on other base weights (frozen "
                             f"tensors' fingerprint {saved} there, {self.base_fingerprint} here): resuming would not "
                             "continue the same run. Fix: the init.path / model.pretrained of the run that wrote it")

    # ---- export -------------------------------------------------------------------------------------------

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.export and not trainer.interrupted:
            self._export(trainer, pl_module)

    @rank_zero_only
    def _export(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        out = self._export_folder(trainer)
        # the tokenizer goes next to a Hugging Face model: the module's own, else the one the data was tokenized with
        tokenizer = getattr(pl_module, "tokenizer", None) or getattr(trainer.datamodule, "tokenizer", None)
        self.exported = export_merged(pl_module, out, tokenizer)
        rank_zero_info(f"PEFTAdapters: merged model written to {out} ({', '.join(sorted(self.exported))})")

    def _export_folder(self, trainer: "pl.Trainer") -> Path:
        return Path(self.export_dir) if self.export_dir else Path(trainer.default_root_dir) / "merged"

    # ---- reports ------------------------------------------------------------------------------------------

    def describe(self) -> dict[str, str]:
        what = (f"{self.method} r={self.r} alpha={self.alpha:g} on {len(self.targets)} modules"
                if self.method != "freeze" else "no adapters (freeze)")
        if self.trainable_modules:
            what += f", + trainable {', '.join(map(str, self.trainable_modules))}"
        rows = {"peft": what + (", adapters-only checkpoints" if self.adapters_only_checkpoints else "")}
        if self.counts is not None:
            trainable, total = self.counts
            rows["trainable parameters"] = (f"{trainable:,} of {total:,} ({100 * trainable / max(total, 1):.2f}%), "
                                            f"{total - trainable:,} frozen")
        return rows

    def final_summary(self) -> dict[str, Any]:
        trainable, total = self.counts or (0, 0)
        return {"method": self.method, "target_modules": len(self.targets), "trainable_params": trainable,
                "total_params": total, "base_fingerprint": self.base_fingerprint, "exported": self.exported,
                "frozen_dropped_from_optimizer": self.dropped_from_optimizer}
