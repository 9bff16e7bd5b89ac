"""A ``CSVLogger`` whose ``metrics.csv`` survives a resume: the rows written before the checkpoint are kept.

Lightning's CSV writer deletes an existing ``metrics.csv`` when it starts ("Previous log files in this directory
will be deleted"), so a run resumed into its own folder (``ckpt_path=last hydra.run.dir=...``) lost every row from
before the interruption. :class:`ResumableCSVLogger` moves the old file aside instead; when the run resumes from a
checkpoint, :class:`~lit_speed.checkpointing.FaultTolerance` tells it how many rows the file held when that
checkpoint was written (it flushes the logger and counts them at every save), and the logger puts exactly those
rows back. Rows logged after the checkpoint by the interrupted run are dropped: the resumed run logs those steps
again, so the file reads as the uninterrupted run's.
"""
from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

METRICS_FILE = "metrics.csv"
ASIDE_SUFFIX = ".before-resume"


class ResumableCSVLogger(CSVLogger):
    """Lightning's ``CSVLogger`` (same arguments) that keeps a resumed run's earlier rows.

    The methods :class:`~lit_speed.checkpointing.FaultTolerance` calls: :meth:`rows_logged` (flush, then count) at
    each checkpoint, :meth:`rows_held` (count without writing) for the in-memory snapshots of its signal deadline,
    and :meth:`restore_rows` when the run resumes from one. Without a resume the old file stays next to the new
    one as ``metrics.csv.before-resume`` (Lightning would have deleted it).

    Example::

        trainer = Trainer(logger=ResumableCSVLogger("logs"), callbacks=[FaultTolerance(), ModelCheckpoint(...)])
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._moved_aside = False
        self._rows_written = 0  # data rows in metrics.csv (this logger wrote or restored them)

    @property
    def metrics_path(self) -> Path:
        return Path(self.log_dir) / METRICS_FILE

    @property  # type: ignore[override]
    @override
    def experiment(self) -> Any:
        if not self._moved_aside:  # before Lightning's writer starts (and deletes what it finds)
            self._moved_aside = True
            if rank_zero_only.rank == 0 and self.metrics_path.is_file():
                os.replace(self.metrics_path, self.metrics_path.with_name(METRICS_FILE + ASIDE_SUFFIX))
        return super().experiment

    @override
    def save(self) -> None:
        pending = len(self.experiment.metrics) if rank_zero_only.rank == 0 else 0
        super().save()
        self._rows_written += pending

    def rows_held(self) -> int | None:
        """Rows logged so far, written or not, counted without touching the file (``None`` off rank 0)."""
        if rank_zero_only.rank != 0:
            return None
        return self._rows_written + len(self.experiment.metrics)

    def rows_logged(self) -> int | None:
        """Write the pending rows, then count the data rows of ``metrics.csv`` (``None`` off rank 0)."""
        if rank_zero_only.rank != 0:
            return None
        self.save()
        if not self.metrics_path.is_file():
            return 0
        with self.metrics_path.open(newline="") as f:
            return max(sum(1 for _ in csv.reader(f)) - 1, 0)

    def restore_rows(self, rows: int) -> int | None:
        """Put back the first ``rows`` rows of the file this run found (moved aside at start); returns how many
        (``None`` off rank 0, or when there was no earlier file: a resume into a new folder)."""
        aside = self.metrics_path.with_name(METRICS_FILE + ASIDE_SUFFIX)
        if rank_zero_only.rank != 0 or not aside.is_file():
            return None
        with aside.open(newline="") as f:
            reader = csv.DictReader(f)
            header = list(reader.fieldnames or [])
            kept = [row for _, row in zip(range(rows), reader)]
        writer = self.experiment
        writer.save()  # anything this run logged already goes first into a file of its own...
        previous = list(csv.DictReader(self.metrics_path.open(newline=""))) if self.metrics_path.is_file() else []
        keys = sorted(set(header) | set(writer.metrics_keys) | {k for r in previous for k in r})
        with self.metrics_path.open("w", newline="") as f:  # ...and after the restored rows here
            out = csv.DictWriter(f, fieldnames=keys)
            out.writeheader()
            out.writerows(kept + previous)
        writer.metrics_keys[:] = keys  # the writer appends under this header from now on
        self._rows_written = len(kept) + len(previous)
        aside.unlink()
        return len(kept)
