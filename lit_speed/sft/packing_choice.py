"""``packing=auto``: packed rows or length-grouped padding, whichever trains this run's epoch faster here.

The two layouts compute different positions (a padded batch computes every row to its longest example; a packed row
is nearly full) at different costs per position (a packed row attends under a block-diagonal mask, the causal kernel
of a padded row needs none, attention grows with the row's length, and a few long rows make larger matmuls than many
short ones). :func:`choose_packing` counts the positions each layout computes over the epoch (exact, from the
lengths), times the model's forward on a typical batch of each (the packed layout's rows per batch at median fill; the
padded layout's examples at its median batch width), interleaved, and compares ``seconds per batch position x the
positions the epoch computes``. The forward runs without gradients, in the run's
precision context, with the RNG states put back, so the run is left as it was; the timings are cached per machine and
shapes (:mod:`lit_speed.tuning`), and on several processes rank 0 decides for all.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable

import numpy as np
import torch

from lit_speed.sft.batches import Layout
from lit_speed.sft.packing import collate_packed, collate_padded
from lit_speed.tuning import Decision, measured_choice, on_rank_zero


def _sample_batches(packed: Layout, padded: Layout) -> tuple[list[list[int]], list[int], int]:
    """A typical batch of each layout: ``packed.batch_size`` rows of median fill, and ``padded.batch_size``
    examples at the median width of the padded epoch's batches (returned as the examples and that width)."""
    fills = np.argsort(packed.item_positions, kind="stable")
    middle = len(fills) // 2
    rows = [list(packed.rows[int(i)]) for i in fills[middle:middle + packed.batch_size]]
    batches = padded.epoch_batches
    widths = [int(padded.item_positions[b].max()) for b in batches]
    median = int(np.argsort(widths, kind="stable")[len(widths) // 2])
    return rows, [int(i) for i in batches[median]], widths[median]


def choose_packing(loss: Callable[[dict[str, torch.Tensor]], torch.Tensor], packed: Layout, padded: Layout,
                   pad_id: int, key: dict[str, Any], context: Callable[[], AbstractContextManager] = nullcontext,
                   device: torch.device | None = None) -> Decision:
    """Time ``loss`` (the model's forward to its loss) on a typical batch of each layout; choose the faster epoch.

    Args:
        loss: ``batch -> loss`` (e.g. the LightningModule's own loss of a batch).
        packed, padded: The run's two layouts of the same training examples.
        key: What the timings depend on besides the machine (the model, its dtype), for the cache.
        context: The run's precision context (autocast), entered around each forward.
    """
    examples = packed.examples
    rows, batch, width = _sample_batches(packed, padded)
    packed_positions, padded_positions = packed.positions()[0], padded.positions()[0]
    pack_sample = collate_packed([[examples.example(i) for i in row] for row in rows], pad_id)
    pad_sample = collate_padded([examples.example(i) for i in batch], pad_id)
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

    scale = {name: positions / samples[name]["input_ids"].numel()
             for name, positions in (("packed", packed_positions), ("padded", padded_positions))}
    full_key = {**key, "packed_batch": list(pack_sample["input_ids"].shape), "padded_batch": [len(batch), width],
                "examples_in_rows": sum(len(r) for r in rows)}
    return on_rank_zero(lambda: measured_choice("data.packing", full_key, {"packed": forward("packed"),
                                                                          "padded": forward("padded")},
                                                default="padded", rounds=3, budget_s=2.0, scale=scale, unit="s"))
