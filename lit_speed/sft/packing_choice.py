"""``packing=auto``: packed rows or length-grouped padding, whichever trains this run's epoch faster here.

The two layouts compute different positions (a padded batch computes every row to its longest example; a packed row
is nearly full) at different costs per position (a packed row attends under a block-diagonal mask, the causal kernel
of a padded row needs none, and attention grows with the row's length). :func:`choose_packing` counts the positions
each layout computes over the epoch (exact, from the lengths), times the model's forward on one row of each, at the
widths the layout really has (a full packed row; a padded row of the median batch width), interleaved, and compares
``seconds per row x rows of that width the epoch computes``. The forward runs without gradients, in the run's
precision context, with the RNG states put back, so the run is left as it was; the timings are cached per machine and
shapes (:mod:`lit_speed.tuning`), and on several processes rank 0 decides for all.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable

import numpy as np
import torch

from lit_speed.sft.batches import GROUP_BATCHES, Layout
from lit_speed.sft.packing import collate_packed, collate_padded, grouped_batches
from lit_speed.tuning import Decision, measured_choice, on_rank_zero


def _sample_rows(packed: Layout, padded: Layout) -> tuple[list[int], int]:
    """The packed row of median fill, and a padded row's width: the median of the padded epoch's batch widths."""
    fills = packed.item_positions
    row = packed.rows[int(np.argsort(fills, kind="stable")[len(fills) // 2])]
    order = np.random.default_rng(0).permutation(len(padded)).tolist()
    batches = grouped_batches(order, padded.item_positions, padded.batch_size, GROUP_BATCHES)
    return list(row), int(np.median([int(padded.item_positions[b].max()) for b in batches]))


def choose_packing(loss: Callable[[dict[str, torch.Tensor]], torch.Tensor], packed: Layout, padded: Layout,
                   pad_id: int, key: dict[str, Any], context: Callable[[], AbstractContextManager] = nullcontext,
                   device: torch.device | None = None) -> Decision:
    """Time ``loss`` (the model's forward to its loss) on one row of each layout and choose the faster epoch.

    Args:
        loss: ``batch -> loss`` (e.g. the LightningModule's own loss of a batch).
        packed, padded: The run's two layouts of the same training examples.
        key: What the timings depend on besides the machine (the model, its dtype), for the cache.
        context: The run's precision context (autocast), entered around each forward.
    """
    examples = packed.examples
    row, width = _sample_rows(packed, padded)
    packed_positions, padded_positions = packed.positions()[0], padded.positions()[0]
    # a padded sample row of `width` positions: the first example at least that long, cut to it (the epoch's typical)
    longer = np.flatnonzero(examples.positions() >= width)
    index = int(longer[0]) if len(longer) else int(np.argmax(examples.positions()))
    ids, trained = examples.example(index)
    pad_sample = collate_padded([(ids[:width + 1], trained[:width + 1])], pad_id)
    pack_sample = collate_packed([[examples.example(i) for i in row]], pad_id)
    samples = {"packed": pack_sample, "padded": pad_sample}
    if device is not None:
        samples = {k: {n: t.to(device) for n, t in v.items()} for k, v in samples.items()}

    def forward(name: str) -> Callable[[], None]:
        def call() -> None:
            with torch.no_grad(), torch.random.fork_rng(devices=[] if device is None or device.type != "cuda"
                                                        else [device]), context():
                loss(samples[name])
            if device is not None and device.type == "cuda":
                torch.cuda.synchronize(device)
        return call

    scale = {"packed": packed_positions / pack_sample["input_ids"].shape[1],
             "padded": padded_positions / pad_sample["input_ids"].shape[1]}
    full_key = {**key, "packed_row": int(pack_sample["input_ids"].shape[1]), "examples_in_row": len(row),
                "padded_row": width}
    return on_rank_zero(lambda: measured_choice("data.packing", full_key, {"packed": forward("packed"),
                                                                          "padded": forward("padded")},
                                                default="padded", rounds=3, budget_s=2.0, scale=scale, unit="s"))
