"""Greedy responses to held-out prompts at each validation, written beside the reference: what a person reads.

``data=sft`` adds it (``callbacks.response_samples``); alone: ``Trainer(callbacks=[ResponseSamples()])`` with a
DataModule that has ``prompts`` (:class:`~lit_speed.sft.samples.SamplePrompt` s) and a model with ``generate_ids``
(:class:`~lit_speed.models.hf_causal_lm.HFCausalLM`).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lit_speed.sft.templates import turn_end_ids


def _cell(text: str, limit: int = 400) -> str:
    """One Markdown table cell: newlines as ``<br>``, pipes escaped, long texts cut with an ellipsis."""
    text = text.strip()
    text = text if len(text) <= limit else text[:limit] + "..."
    return text.replace("|", "\\|").replace("\r", "").replace("\n", "<br>")


class ResponseSamples(Callback):
    """At the end of each validation (not the sanity check), the model answers the DataModule's held-out prompts
    greedily and the answers are appended to ``<run folder>/samples.md``, one table per validation.

    Args:
        max_new_tokens: Tokens generated per answer at most (a generation also stops at the template's end-of-turn).
        filename: The file, in the Trainer's ``default_root_dir`` (the run folder).

    Raises:
        ValueError: ``max_new_tokens < 1``.
    """

    def __init__(self, max_new_tokens: int = 64, filename: str = "samples.md") -> None:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"ResponseSamples(max_new_tokens={max_new_tokens!r}): must be an int >= 1. Fix: "
                             "callbacks.response_samples.max_new_tokens=64")
        self.max_new_tokens, self.filename = max_new_tokens, filename
        self.last: list[dict[str, str]] = []
        self.seconds = 0.0
        self.step: int | None = None  # the optimizer step the last answers were generated at
        self.path: Path | None = None

    def _ready(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> list[Any]:
        prompts = getattr(trainer.datamodule, "prompts", None) if trainer.datamodule is not None else None
        return list(prompts or []) if callable(getattr(pl_module, "generate_ids", None)) else []

    @override
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        prompts = self._ready(trainer, pl_module)
        if trainer.sanity_checking or not prompts or trainer.global_step == self.step:
            return  # the same step again (the final validation after fit): the same weights, the same answers
        start = time.perf_counter()
        dm = trainer.datamodule
        stop = turn_end_ids(dm.tokenizer, dm.template) if dm.template is not None else [dm.tokenizer.eos_token_id]
        rows = []
        with torch.no_grad(), trainer.precision_plugin.forward_context():  # every rank: ZeRO-3 gathers together
            for p in prompts:
                ids = pl_module.generate_ids(p.ids, self.max_new_tokens, stop, dm.pad_id)
                answer = dm.tokenizer.decode([i for i in ids if i not in stop], skip_special_tokens=False)
                rows.append({"prompt": p.prompt, "reference": p.reference, "model": answer,
                             "tokens": len(ids)})
        self.seconds += time.perf_counter() - start
        self.last, self.step = rows, trainer.global_step
        if trainer.is_global_zero:
            self._write(trainer, rows)

    def _write(self, trainer: "pl.Trainer", rows: list[dict[str, Any]]) -> None:
        self.path = Path(trainer.default_root_dir) / self.filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        loss = trainer.callback_metrics.get("val/loss")
        head = f"## step {trainer.global_step}" + (f" (val/loss {float(loss):.4f})" if loss is not None else "")
        lines = [head, "", "| prompt | reference | model (greedy) |", "|---|---|---|"]
        lines += [f"| {_cell(r['prompt'])} | {_cell(r['reference'])} | {_cell(r['model'])} |" for r in rows]
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write("\n".join(lines) + "\n\n")

    def describe(self) -> dict[str, str]:
        return {"response samples": f"greedy answers (<= {self.max_new_tokens} tokens) to held-out prompts at each "
                                    f"validation, in {self.filename}"}

    def phase_seconds(self) -> dict[str, float]:
        return {"response_samples": self.seconds}

    def final_summary(self) -> dict[str, Any]:
        return {"file": str(self.path) if self.path else None, "last": self.last}

    def end_rows(self) -> dict[str, str]:
        if not self.last:
            return {}
        first = self.last[0]
        return {"response sample": f"{_cell(first['prompt'], 60)} -> {_cell(first['model'], 80)} "
                                   f"({len(self.last)} in {self.path})"}
