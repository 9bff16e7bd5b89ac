"""Lightning's rich progress bar, made for runs whose steps take seconds or minutes.

Lightning 2.6.6's ``RichProgressBar`` counts the batches of the current epoch against ``max_epochs`` (``Epoch 0/19
2/397``) even when ``max_steps`` ends the run, and takes its rate and time left from rich's progress samples of the
last 30 s: at one step per 80 s there are none, so it shows ``0.00it/s`` and ``-:--:--`` for hours.
:class:`StepProgressBar` keeps Lightning's bar, its hooks and its metrics column, and changes what it counts and
how fast it says it goes:

- when ``max_steps`` ends the run (``trainer.estimated_stepping_batches == max_steps``), one bar for the whole run:
  optimizer steps done of ``max_steps`` (``12/200 steps``), the epoch in the description without ``/max_epochs``;
  otherwise the epoch's batches, as Lightning counts them;
- the pace over the last :data:`WINDOW` completions (from the fit's first batch when there are fewer), as seconds per
  step when a step takes longer than a second (``81.3 s/step``), else steps (or batches) per second;
- the time left of the run at that pace: steps to ``max_steps``, or the batches of this and the remaining epochs.

:func:`pace_text` and :func:`time_left_s` are plain functions of numbers.
"""
from __future__ import annotations

import time
from collections import deque
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import (
    BatchesProcessedColumn,
    CustomTimeColumn,
    ProcessingSpeedColumn,
)
from rich.text import Text
from typing_extensions import override

#: completions the pace is averaged over (a rate that follows changes, without the jitter of one step)
WINDOW = 20


def pace_text(seconds_per_unit: float | None, unit: str) -> str:
    """``"81.3 s/step"`` when a unit takes longer than a second, else ``"4.20 steps/s"``; ``"-- s/step"`` unknown."""
    if not seconds_per_unit or seconds_per_unit <= 0:
        return f"-- s/{unit}"
    if seconds_per_unit > 1.0:
        return f"{seconds_per_unit:.1f} s/{unit}" if seconds_per_unit < 100 else f"{seconds_per_unit:.0f} s/{unit}"
    return f"{1.0 / seconds_per_unit:.2f} {unit}s/s"


def time_left_s(done: int, total: int | float | None, seconds_per_unit: float | None) -> float | None:
    """Seconds until ``total`` at ``seconds_per_unit`` (``None`` when the total or the pace is unknown)."""
    if total is None or total == float("inf") or not seconds_per_unit:
        return None
    return max(float(total) - done, 0.0) * seconds_per_unit


def clock(seconds: float | None) -> str:
    """``"1:02:03"``; ``"-:--:--"`` unknown."""
    return "-:--:--" if seconds is None else str(timedelta(seconds=int(seconds)))


class _CountColumn(BatchesProcessedColumn):
    def render(self, task: Any) -> Text:
        text = super().render(task)
        unit = task.fields.get("unit")
        return Text(f"{text.plain} {unit}s", style=self.style) if unit else text


class _TimeLeftColumn(CustomTimeColumn):
    def render(self, task: Any) -> Text:
        if "left_s" not in task.fields:  # validation's bars: Lightning's column
            return super().render(task)
        elapsed = task.finished_time if task.finished else task.elapsed
        return Text(f"{clock(elapsed)} • {clock(task.fields['left_s'])} left", style=self.style)


class _PaceColumn(ProcessingSpeedColumn):
    def render(self, task: Any) -> Text:
        pace = task.fields.get("pace")
        return Text(pace, style=self.style) if pace else super().render(task)


class StepProgressBar(RichProgressBar):
    """Lightning's ``RichProgressBar`` counting optimizer steps when ``max_steps`` ends the run, with a pace in
    seconds per step for slow steps and the run's time left. Takes ``RichProgressBar``'s arguments.

    Example::

        trainer = Trainer(max_steps=200, callbacks=[StepProgressBar()])   # "Epoch 0 12/200 steps 0:16:15 • 4:21:33
                                                                          #  left 81.3 s/step"
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.by_steps = False
        self._marks: deque[tuple[float, int]] = deque(maxlen=WINDOW + 1)

    @property
    def total_train_batches(self) -> int | float:
        """``max_steps`` when steps end the run (the bar's total), else Lightning's batches per epoch."""
        return self.trainer.max_steps if self.by_steps else super().total_train_batches

    def _done(self, trainer: "pl.Trainer", batch_idx: int) -> int:
        return trainer.global_step if self.by_steps else batch_idx + 1

    def seconds_per_unit(self) -> float | None:
        """Seconds per step (or batch) over the recent completions; ``None`` before the first one."""
        if len(self._marks) < 2 or self._marks[-1][1] == self._marks[0][1]:
            return None
        (t0, n0), (t1, n1) = self._marks[0], self._marks[-1]
        return (t1 - t0) / (n1 - n0)

    def _run_left_s(self, trainer: "pl.Trainer", done: int, pace: float | None) -> float | None:
        if self.by_steps:
            return time_left_s(done, trainer.max_steps, pace)
        per_epoch = trainer.num_training_batches
        if trainer.max_epochs is None or trainer.max_epochs < 0 or per_epoch == float("inf"):
            return time_left_s(done, per_epoch, pace)  # no end in epochs: this epoch's
        later = (trainer.max_epochs - trainer.current_epoch - 1) * per_epoch
        return time_left_s(done, per_epoch + later, pace)

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        max_steps = trainer.max_steps
        self.by_steps = max_steps is not None and max_steps > 0 and trainer.estimated_stepping_batches == max_steps
        self._marks.clear()
        self._marks.append((time.monotonic(), trainer.global_step if self.by_steps else 0))
        super().on_train_start(trainer, pl_module)

    @override
    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not self.by_steps:
            self._marks.clear()  # batches count from 0 again
            self._marks.append((time.monotonic(), 0))
        if self.by_steps and self.progress is not None and self.train_progress_bar_id is not None:
            # one bar for the whole run: not reset at each epoch, only its description
            self.progress.update(self.train_progress_bar_id, description=f"Epoch {trainer.current_epoch}")
            self.refresh()
            return
        super().on_train_epoch_start(trainer, pl_module)
        if self.by_steps and self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, description=f"Epoch {trainer.current_epoch}",
                                 completed=trainer.global_step, unit="step")

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        done = self._done(trainer, batch_idx)
        if self._marks and done != self._marks[-1][1]:
            self._marks.append((time.monotonic(), done))
        if not self.by_steps:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        elif not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()  # resumed mid-epoch
        if self.progress is None or self.train_progress_bar_id is None or self.is_disabled:
            return
        pace = self.seconds_per_unit()
        unit = "step" if self.by_steps else "batch"
        fields = {"pace": pace_text(pace, unit), "left_s": self._run_left_s(trainer, done, pace)}
        if self.by_steps:
            fields.update(completed=done, unit="step", description=f"Epoch {trainer.current_epoch}")
        self.progress.update(self.train_progress_bar_id, **fields)
        if self.by_steps:  # what Lightning's own batch end does after its update
            self._update_metrics(trainer, pl_module)
            self.refresh()

    @override
    def configure_columns(self, trainer: "pl.Trainer") -> list:
        replace = {CustomTimeColumn: _TimeLeftColumn, ProcessingSpeedColumn: _PaceColumn,
                   BatchesProcessedColumn: _CountColumn}
        return [replace[type(c)](style=c.style) if type(c) in replace else c for c in super().configure_columns(trainer)]
