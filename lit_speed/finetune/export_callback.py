"""Export the trained model after fit when every parameter trains (``peft=none``): the finished model of a full
fine-tune, as :class:`~lit_speed.finetune.peft_callback.PEFTAdapters` exports the merged one of a LoRA run.

A Hugging Face model comes out as a ``save_pretrained`` folder (``hf/``, float32, with the tokenizer), which is what
``transformers.Trainer.save_model`` leaves and what ``from_pretrained`` loads; the Lightning checkpoint stays what
resumes. ``export="auto"`` (the default) writes that folder for a Hugging Face model only: for the bundled models the
checkpoint is the deliverable, and ``export=True`` writes their ``model.pt`` too.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lit_speed import strategy_facts
from lit_speed.finetune.export import (
    EXPORT_FORMATS,
    check_export_dir,
    check_export_dtype,
    export_after_fit,
    hf_children,
)

EXPORTS = ("auto", True, False)


class ExportModel(Callback):
    """After fit, write the trained model into ``export_dir``; the module itself is left as it is.

    Args:
        export: ``auto``: a Hugging Face model's ``save_pretrained`` folder, nothing for other models (their
            checkpoint is the result); ``True``: always (``model.pt`` for a model that is not a Hugging Face one);
            ``False``: never.
        export_dir: Folder for the export; ``None`` = ``<trainer.default_root_dir>/model``.
        export_format: ``auto`` (``hf/`` for a Hugging Face model, else ``model.pt``), ``hf`` or ``state_dict``.
        export_dtype: ``auto`` (the dtype the model's folder declares, else float32), ``float32``, ``bfloat16``
            or ``float16``.

    Raises:
        ValueError: An unknown ``export`` or ``export_format``; a folder that cannot be written (at setup, before
            any training); ``export=True`` under ZeRO stage 3 (each process holds a slice of every weight).

    Example::

        trainer = Trainer(callbacks=[ExportModel(export_dir="out/model")])   # out/model/hf/ after fit
    """

    def __init__(self, export: bool | str = "auto", export_dir: str | None = None,
                 export_format: str = "auto", export_dtype: str = "auto") -> None:
        if export not in EXPORTS:
            raise ValueError(f"ExportModel(export={export!r}): one of auto, true, false. Fix: export=auto (a Hugging "
                             "Face model's save_pretrained folder after fit)")
        if export_format not in EXPORT_FORMATS:
            raise ValueError(f"ExportModel(export_format={export_format!r}): must be one of "
                             f"{', '.join(EXPORT_FORMATS)}. Fix: export_format=auto (hf/ for a Hugging Face model, "
                             "else model.pt)")
        self.export = export if export == "auto" else bool(export)
        self.export_dir, self.export_format = export_dir, export_format
        self.export_dtype = check_export_dtype("ExportModel", export_dtype)
        self.active: bool | None = None  # decided at setup, when the model and the strategy are known
        self.holds_hf: bool | None = None  # the model holds a Hugging Face model (known from prepare_model on)
        self.reason = ""
        self.exported: dict[str, str] = {}
        self.export_seconds: float | None = None

    def prepare_model(self, model: Any) -> None:
        """Note whether ``model`` holds a Hugging Face model (the model is not changed): the runner calls it before
        the start-up table, whose export row then says what happens to this model (``run_contract.ModelPreparer``)."""
        self.holds_hf = bool(hf_children(model))

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        hf = bool(hf_children(pl_module))
        stage3 = strategy_facts(trainer.strategy).zero_stage == 3
        if self.export is True and stage3:
            raise ValueError("ExportModel(export=True): cannot export under ZeRO stage 3 (each process holds a slice "
                             "of every weight). Fix: peft.export=auto, then scripts/consolidate.py and "
                             "lit_speed.finetune.export_merged on the consolidated model; or strategy=zero2")
        if self.export is not False and self.export_format == "hf" and not hf:
            raise ValueError(f"ExportModel(export_format='hf'): {type(pl_module).__name__} holds no Hugging Face model "
                             "(a child with save_pretrained and a config). Fix: export_format=auto (model.pt)")
        if self.export is False:
            self.active, self.reason = False, "off (peft.export=false)"
        elif stage3:
            self.active, self.reason = False, "not under ZeRO-3 (scripts/consolidate.py writes the whole model)"
        elif self.export == "auto" and not hf:
            self.active, self.reason = False, "none: the checkpoint is the result (peft.export=true writes model.pt)"
        else:
            self.active, self.reason = True, f"after fit, to {self._export_folder(trainer)}"
        if self.active and trainer.is_global_zero:  # rank 0 exports: fail now, not after training
            check_export_dir(self._export_folder(trainer), owner="ExportModel", what="trained")
        if self.export == "auto" and stage3 and hf:
            rank_zero_info(f"ExportModel: {self.reason}")

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.active and not trainer.interrupted:
            written = export_after_fit(trainer, pl_module, self._export_folder(trainer), self.export_format,
                                       label="ExportModel: trained model", dtype=self.export_dtype)
            if written is not None:  # rank 0
                self.exported, self.export_seconds = written

    def _export_folder(self, trainer: "pl.Trainer") -> Path:
        return Path(self.export_dir) if self.export_dir else Path(trainer.default_root_dir) / "model"

    def describe(self) -> dict[str, str]:
        """The start-up table's row: none for a model ``export=auto`` leaves alone (the bundled models: their
        checkpoint is the result), once :meth:`prepare_model` has seen it."""
        if self.active is None:  # the startup table comes before setup
            folder = self.export_dir or "<run folder>/model"
            if self.export == "auto" and self.holds_hf is False:
                return {}
            auto = f"after fit, a save_pretrained folder in {folder}/hf" if self.holds_hf else \
                f"after fit, if a Hugging Face model (save_pretrained folder in {folder}/hf)"
            when = {"auto": auto, True: f"after fit, to {folder}", False: "off (peft.export=false)"}[self.export]
            return {"export": f"trained model: {when}"}
        return {"export": f"trained model: {self.reason}"}

    def phase_seconds(self) -> dict[str, float]:
        """``{"export": seconds}`` of the export (lit_speed.run_contract.PhaseTimer)."""
        return {"export": self.export_seconds or 0.0}

    def final_summary(self) -> dict[str, Any]:
        return {"export": self.export, "exported": self.exported, "export_s": self.export_seconds,
                "reason": self.reason}
