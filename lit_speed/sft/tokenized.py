"""Records to token ids and trained masks, once per data set and tokenizer (a cached ``datasets.map``), then lengths.

:func:`tokenize_records` renders every record with the template (:mod:`lit_speed.sft.masking`), tokenizes it with
offsets and writes ``input_ids`` and ``trained`` columns to an Arrow file in the cache, keyed by the records'
fingerprint, the tokenizer's vocabulary, the template and the options: a second run maps nothing. A record that
cannot be trained on stops it with the record's file and line (:class:`~lit_speed.sft.loading.DataError`).
:class:`TokenizedExamples` holds the columns as flat arrays (memory-mapped by Arrow) and applies the length rule:
examples longer than ``max_length`` are truncated (their start kept, as TRL's ``truncation_mode="keep_start"``) or
dropped, and an example left without a trained token is dropped; both are counted.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lit_speed.sft.formats import Detected, RecordError, to_conversation
from lit_speed.sft.loading import DataError, Records
from lit_speed.sft.masking import render_spans, tokenize_spans
from lit_speed.sft.templates import Template

OVERLONG = ("truncate", "drop")
MAP_BATCH = 256  # records rendered and tokenized per call (the tokenizer encodes a batch in parallel)


def _tokenize_batch(batch: dict[str, list], indices: list[int], tokenizer: Any, detected: Detected,
                    template: str | None, train_on: str) -> dict[str, list]:
    rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    texts, spans = [], []
    for index, record in zip(indices, rows):
        try:
            text, span = render_spans(tokenizer, to_conversation(record, detected), template, train_on,
                                      getattr(tokenizer, "eos_token", None))
        except RecordError as error:
            error.row = index
            raise
        texts.append(text)
        spans.append(span)
    ids, masks = tokenize_spans(tokenizer, texts, spans)
    return {"input_ids": ids, "trained": [m.astype(np.int8) for m in masks]}


def tokenize_records(records: Records, tokenizer: Any, detected: Detected, template: Template | None,
                     train_on: str, cache_dir: str | Path, tokenizer_key: str, setting: str = "data.source") -> Any:
    """``datasets.Dataset`` with ``input_ids`` and ``trained`` per record (cached, see the module docstring).

    Raises:
        DataError: A record that cannot be rendered or trained on, with its file and line and the fix.
    """
    key = hashlib.sha256("|".join([records.fingerprint, tokenizer_key, detected.format, str(sorted(
        detected.columns.items())), template.text if template else "", train_on, "v1"]).encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"sft-tokens-{key}.arrow"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        return records.dataset.map(
            _tokenize_batch, batched=True, batch_size=MAP_BATCH, with_indices=True,
            fn_kwargs={"tokenizer": tokenizer, "detected": detected, "template": template.text if template else None,
                       "train_on": train_on},
            remove_columns=records.dataset.column_names, cache_file_name=str(path), new_fingerprint=key,
            load_from_cache_file=True, desc="render and tokenize")
    except RecordError as error:
        fix = error.fix or "correct or remove that record"
        raise DataError(f"{setting}: {records.where(error.row or 0)}: {error.problem}. Fix: {fix}") from None


@dataclass
class TokenizedExamples:
    """Flat token ids and trained flags of every kept example, its slice of them, and what the length rule did.

    Args:
        tokenized: The output of :func:`tokenize_records` (or any table with ``input_ids`` and ``trained``).
        max_length: Tokens per example at most (the prompt included).
        overlong: ``truncate`` (keep the first ``max_length`` tokens) or ``drop``.
        rows: The records to take (e.g. the training rows), in order; ``None``: all.
    """

    tokenized: Any
    max_length: int
    overlong: str = "truncate"
    rows: np.ndarray | None = None
    ids: np.ndarray = field(init=False)
    trained: np.ndarray = field(init=False)
    starts: np.ndarray = field(init=False)
    lengths: np.ndarray = field(init=False)
    index: np.ndarray = field(init=False)  # the record (row of ``tokenized``) each kept example came from
    counts: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        table = self.tokenized.data.table if hasattr(self.tokenized, "data") else self.tokenized
        ids_col = table.column("input_ids").combine_chunks()
        trained_col = table.column("trained").combine_chunks()
        self.ids = ids_col.values.to_numpy(zero_copy_only=False)
        self.trained = trained_col.values.to_numpy(zero_copy_only=False).astype(bool)
        offsets = ids_col.offsets.to_numpy().astype(np.int64)
        rows = np.arange(len(offsets) - 1) if self.rows is None else np.asarray(self.rows, dtype=np.int64)
        starts = offsets[:-1][rows]
        full = offsets[1:][rows] - starts
        lengths = np.minimum(full, self.max_length)
        overlong = full > self.max_length
        keep = ~overlong if self.overlong == "drop" else np.ones(len(full), dtype=bool)
        # trained targets of each (truncated) example: flags at positions 1 .. n-1 (the first token is never a target)
        cumulative = np.concatenate([[0], np.cumsum(self.trained, dtype=np.int64)])
        targets = np.where(lengths >= 2, cumulative[starts + lengths] - cumulative[np.minimum(starts + 1, starts +
                                                                                             lengths)], 0)
        self.counts = {"records": int(len(full)), "overlong": int(overlong.sum()),
                       "truncated": int(overlong.sum()) if self.overlong == "truncate" else 0,
                       "dropped_overlong": int(overlong.sum()) if self.overlong == "drop" else 0,
                       "dropped_untrained": int((keep & (targets == 0)).sum())}
        keep &= targets > 0
        self.index = rows[keep]
        self.starts, self.lengths = starts[keep], lengths[keep]
        self.counts.update(examples=int(keep.sum()), tokens=int(self.lengths.sum()),
                           trained_tokens=int(targets[keep].sum()))

    def __len__(self) -> int:
        return len(self.lengths)

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and trained flags of the ``i``-th kept example (truncated to ``max_length``)."""
        start, n = int(self.starts[i]), int(self.lengths[i])
        return self.ids[start:start + n].astype(np.int64), self.trained[start:start + n]

    def positions(self) -> np.ndarray:
        """Positions each example fills as training data (``length - 1``: inputs ``ids[:-1]``)."""
        return self.lengths - 1

    def check_not_empty(self, setting: str, what: str = "training") -> None:
        """Raises DataError when no example is left, saying what removed them and the fix."""
        if len(self):
            return
        c = self.counts
        why = []
        if c["dropped_overlong"]:
            why.append(f"{c['dropped_overlong']} longer than max_length={self.max_length} were dropped "
                       "(data.overlong=drop)")
        if c["dropped_untrained"]:
            why.append(f"{c['dropped_untrained']} had no trained token within max_length={self.max_length}")
        fix = "data.overlong=truncate, or a larger data.max_length" if c["dropped_overlong"] else \
            "a larger data.max_length (the responses start after it)"
        raise DataError(f"{setting}: no {what} example is left of {c['records']}: {'; '.join(why)}. Fix: {fix}")
