"""Supervised fine-tuning data: the user's instruction or chat examples as next-token batches that train on responses.

``python scripts/train.py experiment=sft_lora model.pretrained=<folder> data.source=<examples.jsonl>``

A thin shell over the plain functions of :mod:`lit_speed.sft`: read (``datasets``), detect the format, render with the
chat template, mask, tokenize (cached), hold out validation, and batch (packed rows or length-grouped padding). Each
batch is a dict: ``input_ids``, ``labels`` (the next token, ``-100`` where not trained), ``attention_mask`` (1 on
real positions) and, for packed rows, ``position_ids`` restarting at every example.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Callable, Mapping, Sequence

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader
from typing_extensions import override

from lit_speed import ResumableOrderHooks, ResumableShuffle, load_tokenizer, tokenizer_fingerprint
from lit_speed.data.pipeline import BatchFetch, LoaderOptions, ResumableDataLoader, check_batch_transform
from lit_speed.run_contract import SummaryExtra, TokenLimits
from lit_speed.sft.batches import Layout
from lit_speed.sft.formats import describe_formats, detect_format, to_conversation
from lit_speed.sft.loading import load_records
from lit_speed.sft.masking import TRAIN_ON
from lit_speed.sft.packing_choice import choose_packing
from lit_speed.sft.samples import SamplePrompt, sample_prompts
from lit_speed.sft.stdlib_examples import write_jsonl
from lit_speed.sft.templates import Template, resolve_template
from lit_speed.sft.tokenized import OVERLONG, TokenizedExamples, tokenize_records
from lit_speed.sft.val_split import check_val_size, held_out_rows

PACKING = ("auto", True, False)


class SFTDataModule(ResumableOrderHooks, pl.LightningDataModule):
    """Instruction and chat examples for supervised fine-tuning of a causal LM (``model=hf_causal_lm``).

    Args:
        source: A ``.jsonl``/``.json``/``.parquet``/``.csv`` file, a list of them, a glob, a folder, a Hugging Face
            dataset id, or ``stdlib``: chat examples built from this Python's standard library
            (:mod:`lit_speed.sft.stdlib_examples`).
        tokenizer: The model's tokenizer (a folder or hub id, ``${model.pretrained}``), or a tokenizer object.
        cache_dir: Where ``datasets`` keeps its Arrow files and the tokenized examples are cached.
        split: The split of a dataset id to train on.
        val_source: Files (or, for a dataset id, a split name) to validate on; ``None``: hold out ``val_size``.
        val_size: Examples held out for validation (an int), or a share of them (a float below 1); ``auto``: 5%,
            at least 1 and at most 128. The held-out rows are the same for the same data (seeded, not by the run).
        format: ``auto`` (detected from the columns) or one of :data:`lit_speed.sft.formats.FORMATS`.
        columns: ``{format column: your column}``, e.g. ``{prompt: question, completion: answer}``.
        template: ``auto`` (the tokenizer's chat template), a named one (``chatml``, ``llama3``, ``alpaca``,
            ``none``) or a ``.jinja`` file; see :mod:`lit_speed.sft.templates`.
        train_on: ``responses`` (every assistant turn, the default), ``last_response`` or ``all`` tokens.
        max_length: Tokens per example at most, prompt included.
        overlong: ``truncate`` (keep the start) or ``drop`` examples longer than ``max_length``.
        packing: ``True`` (rows of several examples, attention kept inside each), ``False`` (length-grouped
            padding) or ``auto``: the faster for this run, timed on the model at fit start (:mod:`packing_choice`).
        batch_size: Examples per micro-batch (packed: the rows of ``max_length`` positions that hold that many
            examples on average, so both layouts make the same steps over the same examples).
        shuffle: Draw each epoch's order at random (resumable, as ``shuffle=True``); ``False``: the data's order
            (examples as they are in the files, packed rows as packed), e.g. data already ordered by a curriculum.
        samples: Validation prompts whose greedy responses :class:`~lit_speed.sft.response_samples.ResponseSamples`
            writes at each validation.
        num_workers, pin_memory, persistent_workers, prefetch_factor, batch_transform: As every DataModule here.

    Example::

        dm = SFTDataModule("train.jsonl", tokenizer="path/to/model", cache_dir=".cache/sft", max_length=512)
    """

    data_name = "sft"
    batch_kind = "token-dict->next-token"  # {input_ids, labels, attention_mask[, position_ids]} (run_contract)
    loss_items = "tokens"  # AccumulationScheduler(normalize="auto"): the loss per trained token, not per example

    def __init__(self, source: str | Sequence[str], tokenizer: Any, cache_dir: str, split: str = "train",
                 val_source: str | Sequence[str] | None = None, val_size: int | float | str = "auto",
                 format: str = "auto", columns: Mapping[str, str] | None = None, template: str | None = "auto",
                 train_on: str = "responses", max_length: int = 1024, overlong: str = "truncate",
                 packing: bool | str = "auto", batch_size: int = 4, shuffle: bool = True, samples: int = 3,
                 num_workers: int | str = 0,
                 pin_memory: bool | str = "auto", persistent_workers: bool | None = None,
                 prefetch_factor: int | None = None, batch_transform: Callable[[Any], Any] | None = None) -> None:
        super().__init__()
        owner = type(self).__name__
        # plain values: hyperparameters go into every checkpoint, which a safe load must be able to read
        source, val_source = (s if s is None or isinstance(s, str) else [str(x) for x in s] for s in (source, val_source))
        columns = {str(k): str(v) for k, v in (columns or {}).items()}
        for name, value, allowed in (("train_on", train_on, TRAIN_ON), ("overlong", overlong, OVERLONG),
                                     ("packing", packing, PACKING)):
            if value not in allowed or (name == "packing" and isinstance(value, int) and not isinstance(value, bool)):
                raise ValueError(f"{owner}({name}={value!r}): must be one of {', '.join(map(str, allowed))}. Fix: "
                                 f"data.{name}={allowed[0]}")
        for name, value, low in (("max_length", max_length, 2), ("batch_size", batch_size, 1), ("samples", samples, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{owner}({name}={value!r}): must be an int >= {low}. Fix: data.{name}="
                                 f"{ {'max_length': 1024, 'batch_size': 4, 'samples': 3}[name]}")
        self.loader = LoaderOptions(num_workers, pin_memory, persistent_workers, prefetch_factor)
        self.save_hyperparameters(ignore=["batch_transform", "tokenizer"])
        self.batch_transform = check_batch_transform(owner, batch_transform)
        self.val_size = check_val_size(val_size, owner)
        self.tokenizer_source, self.batch_size, self.max_length = tokenizer, batch_size, max_length
        self.packing = packing
        self._tokenizer: Any = None
        self.template: Template | None = None
        self.train_examples: TokenizedExamples | None = None
        self.val_examples: TokenizedExamples | None = None
        self.layout: Layout | None = None
        self.packing_reason = ""
        self.prompts: list[SamplePrompt] = []
        self.detected = None
        self.train_order = ResumableShuffle(self.data_name)
        self._seen = {"positions": 0, "real": 0, "trained": 0, "batches": 0}

    # ------------------------------------------------------------------ data
    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            source = self.tokenizer_source
            self._tokenizer = load_tokenizer(str(source)) if isinstance(source, (str, os.PathLike)) else source
        return self._tokenizer

    @property
    def pad_id(self) -> int:
        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        return int(pad if pad is not None else 0)

    def _cache(self, *parts: str) -> str:
        return os.path.join(self.hparams.cache_dir, *parts)

    def _tokenized(self, source: Any, split: str, setting: str) -> tuple[Any, Any]:
        h = self.hparams
        if source == "stdlib":  # the bundled examples: built from this Python's standard library, once
            source = str(write_jsonl(self._cache("examples"), "chat"))
        records = load_records(source, split, self._cache("datasets"), setting)
        if self.detected is None:
            self.detected = detect_format(records.dataset.column_names, h.format, h.columns, type(self).__name__)
            if self.detected.format != "text":
                self.template = resolve_template(self.tokenizer, h.template, type(self).__name__)
                if self.template.name:  # the export's tokenizer carries the template the model was trained with
                    self.tokenizer.chat_template = self.template.text
        else:
            detect_format(records.dataset.column_names, self.detected.format, h.columns, type(self).__name__)
        tokens = tokenize_records(records, self.tokenizer, self.detected, self.template, h.train_on, self._cache(),
                                  tokenizer_fingerprint(self.tokenizer), setting)
        return records, tokens

    @override
    def prepare_data(self) -> None:
        self._tokenized(self.hparams.source, self.hparams.split, "data.source")

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.train_examples is not None:
            return
        h = self.hparams
        records, tokens = self._tokenized(h.source, h.split, "data.source")
        if h.val_source is not None:  # files, or for a dataset id the name of another split of it
            hub = records.parts[0].kind == "hub"
            val_records, val_tokens = self._tokenized(h.source if hub else h.val_source,
                                                      h.val_source if hub else "train", "data.val_source")
            train_rows = np.arange(len(tokens))
            val_rows = np.arange(len(val_tokens))
        else:
            val_records, val_tokens = records, tokens
            val_rows = held_out_rows(self.val_size, len(tokens), type(self).__name__)
            train_rows = np.setdiff1d(np.arange(len(tokens)), val_rows)
        self.train_examples = TokenizedExamples(tokens, h.max_length, h.overlong, train_rows)
        self.val_examples = TokenizedExamples(val_tokens, h.max_length, h.overlong, val_rows)
        self.train_examples.check_not_empty("data.source", "training")
        self.val_examples.check_not_empty("data.val_source" if h.val_source else "data.val_size", "validation")
        if self.detected.format != "text" and h.samples:
            self.prompts = sample_prompts(self.tokenizer, self.template, [
                to_conversation(val_records.dataset[int(r)], self.detected) for r in self.val_examples.index[:h.samples]],
                h.max_length)

    def use_packing(self, packed: bool, reason: str) -> None:
        """Fix the training layout (the measured choice of ``packing=auto`` calls this before the first batch)."""
        self.layout = Layout(self.train_examples, self.batch_size, self.max_length, packed)
        self.packing_reason = reason

    def _layout(self) -> Layout:
        if self.layout is not None:
            return self.layout
        if self.packing != "auto":
            self.use_packing(bool(self.packing), f"data.packing={str(self.packing).lower()}")
            return self.layout
        packed, padded = (Layout(self.train_examples, self.batch_size, self.max_length, p) for p in (True, False))
        module = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        if module is None or not callable(getattr(module, "batch_loss", None)):  # alone: no model to time
            fewer = packed if packed.positions()[0] < padded.positions()[0] else padded
            self.layout, self.packing_reason = fewer, "fewer positions to compute (not timed: no model)"
            return self.layout
        config = str(getattr(getattr(module, "model", None), "config", ""))  # the architecture's dimensions
        key = {"model": type(module).__name__, "config": hashlib.sha256(config.encode()).hexdigest()[:16],
               "precision": type(self.trainer.precision_plugin).__name__, "max_length": self.max_length}
        decision = choose_packing(module.batch_loss, packed, padded, self.pad_id, key,
                                  self.trainer.precision_plugin.forward_context, module.device)
        self.layout = packed if decision.chosen == "packed" else padded
        self.packing_reason = f"auto: {decision.reason}"
        rank_zero_info(f"SFTDataModule: packing=auto -> {decision.chosen} ({decision.reason})")
        return self.layout

    @override
    def train_dataloader(self) -> DataLoader:
        layout = self._layout()
        batching = layout.batching if self.hparams.shuffle else layout.in_order
        sampler = self.train_order.sampler_for(len(layout), layout.batch_size, False, self.trainer, batching)
        return ResumableDataLoader(BatchFetch(layout.dataset(self.pad_id)), sampler=sampler, batch_size=None,
                                   **self.loader.kwargs(preloaded=False, trainer=self.trainer))

    @override
    def val_dataloader(self) -> DataLoader:
        val = Layout(self.val_examples, self.batch_size, self.max_length, packed=False)
        order = np.argsort(-val.item_positions, kind="stable").tolist()  # longest first: little padding, fixed
        batches = [order[b:b + self.batch_size] for b in range(0, len(order), self.batch_size)]
        kwargs = {**self.loader.kwargs(preloaded=False, trainer=self.trainer), "persistent_workers": False}
        return DataLoader(BatchFetch(val.dataset(self.pad_id)), sampler=batches, batch_size=None, **kwargs)

    @override
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.trainer is not None and self.trainer.training:  # what the training batches hold (the run's share)
            mask = batch["attention_mask"]
            self._seen["positions"] += mask.numel()
            self._seen["real"] += int(mask.sum())
            self._seen["trained"] += int((batch["labels"] != -100).sum())
            self._seen["batches"] += 1
        return batch

    def largest_batch_positions(self) -> int:
        """Positions of the largest training micro-batch any epoch can draw: its rows (packed) or examples (padded)
        times the longest of them, which a step's activations and logits scale with. ``packing=auto`` (timed at fit
        start): the larger of the two layouts. The memory estimate reads it before the weights load
        (``lit_speed.run.memory_fit.fit_check``): ``batch_size x max_length`` overstated a packed step whose rows
        hold ``batch_size`` examples on average (0.5B ``experiment=sft_lora``: 2048 positions for 1024)."""
        self.setup()
        layouts = [Layout(self.train_examples, self.batch_size, self.max_length, packed)
                   for packed in ((True, False) if self.packing == "auto" else (bool(self.packing),))]
        return max(layout.batch_size * int(layout.item_positions.max()) for layout in layouts)

    # ------------------------------------------------------------------ what the run reports
    def token_limits(self) -> TokenLimits:
        """The tokenizer's vocabulary and ``max_length`` positions (``lit_speed.run_contract.TokenSource``)."""
        source = self.tokenizer_source if isinstance(self.tokenizer_source, (str, os.PathLike)) else \
            type(self.tokenizer_source).__name__
        return TokenLimits(len(self.tokenizer), self.max_length, f"tokenizer={source}",
                           positions_source=f"max_length={self.max_length}")

    def describe(self) -> dict[str, str]:
        self.setup()
        tr, va, c = self.train_examples, self.val_examples, self.train_examples.counts
        lengths = tr.lengths
        rows = {"data": f"sft {self.hparams.source}: {len(tr):,} train / {len(va):,} val examples, "
                        f"{describe_formats(self.detected)}",
                "template": "none: plain text, every token trained" if self.template is None else self.template.source,
                "loss on": f"{self.hparams.train_on}: {c['trained_tokens']:,} of {c['tokens']:,} tokens "
                           f"({c['trained_tokens'] / max(c['tokens'], 1):.0%}); prompts, system turns and padding masked",
                "lengths": f"max_length {self.max_length}: median {int(np.median(lengths))}, max {int(lengths.max())} "
                           f"tokens; {c['overlong']} longer ({'truncated' if self.hparams.overlong == 'truncate' else 'dropped'}),"
                           f" {c['dropped_untrained']} dropped (no trained token left)"}
        if self.layout is not None or self.packing != "auto":
            layout = self._layout()
            per = f", {layout.batch_size} rows per batch" if layout.packed else ""
            rows["batching"] = (f"{layout.name} ({self.packing_reason}): {len(layout):,} "
                                f"{'rows' if layout.packed else 'examples'}{per}, {layout.padding_share():.1%} padding")
        else:
            rows["batching"] = "packing=auto: packed rows or length-grouped padding, timed on the model at fit start"
        return rows

    def summary_extras(self) -> list[SummaryExtra]:
        """Padding share and trained-token share of the training batches the run used."""
        s = self._seen
        if not s["positions"]:
            return []
        return [SummaryExtra("sft_padding_share", "padding share of training positions",
                             1.0 - s["real"] / s["positions"]),
                SummaryExtra("sft_trained_tokens", "trained (response) tokens", float(s["trained"]))]

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.layout is not None:  # a resumed run keeps the layout (the order of its batches depends on it)
            state["packing"] = {"packed": self.layout.packed, "reason": self.packing_reason}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        saved = state_dict.get("packing")
        if saved is not None:
            self.setup()
            self.use_packing(bool(saved["packed"]), f"{saved['reason']}; kept from the checkpoint")
