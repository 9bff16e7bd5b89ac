"""Split training time into data wait, forward+backward and optimizer step from marks set at hook boundaries.

A *mark* is a timestamp taken at one of three points of a training batch:

- ``"batch_start"``: the loop has the next batch (``on_train_batch_start``),
- ``"before_optimizer"``: backward is done and the optimizer is about to step (``on_before_optimizer_step``),
- ``"batch_end"``: the batch is finished (``on_train_batch_end``).

The time between two consecutive marks goes to the segment named by where it ends: ending at
``batch_start`` it was spent waiting for data; ending at ``before_optimizer`` it was forward+backward;
ending at ``batch_end`` it was the optimizer step if the previous mark was ``before_optimizer``, else
forward+backward (a batch that only accumulates gradients). :meth:`StepTimer.pause` drops the gap in
which validation (and the checkpoint it triggers) runs.

On CPU a mark is ``time.perf_counter()`` and exact. On CUDA a mark records a CUDA event on the current
stream, so marking never waits for the device; events are read only when :meth:`StepTimer.flush` is
called at an interval boundary, and then measure GPU time (a data wait is time the GPU sat idle because
the host had no batch to launch).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

MARKS = ("batch_start", "before_optimizer", "batch_end")


@dataclass
class TimeSplit:
    """Seconds per segment and the number of finished batches they cover."""

    data_wait_s: float = 0.0
    forward_backward_s: float = 0.0
    optimizer_s: float = 0.0
    batches: int = 0

    @property
    def total_s(self) -> float:
        return self.data_wait_s + self.forward_backward_s + self.optimizer_s

    def add(self, other: "TimeSplit") -> None:
        self.data_wait_s += other.data_wait_s
        self.forward_backward_s += other.forward_backward_s
        self.optimizer_s += other.optimizer_s
        self.batches += other.batches

    def fractions(self) -> dict[str, float]:
        """Share of each segment in the total (0 when nothing was timed)."""
        total = self.total_s
        if total <= 0:
            return {"data_wait": 0.0, "forward_backward": 0.0, "optimizer": 0.0}
        return {"data_wait": self.data_wait_s / total, "forward_backward": self.forward_backward_s / total,
                "optimizer": self.optimizer_s / total}


def attribute(previous: str, current: str) -> str:
    """The segment a gap belongs to, from the marks that open (``previous``) and close (``current``) it."""
    if current == "batch_start":
        return "data_wait"
    if current == "before_optimizer":
        return "forward_backward"
    if current == "batch_end":
        return "optimizer" if previous == "before_optimizer" else "forward_backward"
    raise ValueError(f"mark must be one of {MARKS}, got {current!r}")


class StepTimer:
    """Collect marks cheaply on the hot path; turn them into a :class:`TimeSplit` at :meth:`flush`.

    Args:
        cuda: Record CUDA events instead of host timestamps (no device sync until :meth:`flush`).
        clock: Host clock in seconds (``time.perf_counter``; injectable for tests).
        event_factory: Makes one timing event with ``record()``, ``elapsed_time(end)`` in milliseconds and
            ``synchronize()`` (``torch.cuda.Event(enable_timing=True)``; injectable for tests).

    Example::

        timer = StepTimer()
        timer.mark("batch_start"); loss.backward(); timer.mark("before_optimizer")
        opt.step(); timer.mark("batch_end")
        split = timer.flush()  # TimeSplit(data_wait_s=0.0, forward_backward_s=..., optimizer_s=..., batches=1)
    """

    def __init__(self, cuda: bool = False, clock: Callable[[], float] = time.perf_counter,
                 event_factory: Callable[[], Any] | None = None) -> None:
        self.cuda = cuda
        self.clock = clock
        self.event_factory = event_factory or (lambda: torch.cuda.Event(enable_timing=True))
        self._marks: list[tuple[str, Any] | None] = []

    def mark(self, label: str) -> None:
        if self.cuda:
            stamp = self.event_factory()
            stamp.record()
        else:
            stamp = self.clock()
        self._marks.append((label, stamp))

    def pause(self) -> None:
        """Break the chain: the gap up to the next mark is not attributed to any segment."""
        if self._marks and self._marks[-1] is not None:
            self._marks.append(None)

    def _elapsed(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000.0 if self.cuda else end - start

    def flush(self) -> TimeSplit:
        """Attribute every closed gap since the last flush; keep the newest mark to open the next gap."""
        recorded = [m for m in self._marks if m is not None]
        if self.cuda and recorded:
            recorded[-1][1].synchronize()  # the one wait, once per interval, never per step
        split = TimeSplit()
        for previous, current in zip(self._marks, self._marks[1:]):
            if previous is None or current is None:
                continue
            seconds = self._elapsed(previous[1], current[1])
            segment = attribute(previous[0], current[0])
            setattr(split, f"{segment}_s", getattr(split, f"{segment}_s") + seconds)
            split.batches += current[0] == "batch_end"
        self._marks = self._marks[-1:]
        return split

    def reset(self) -> None:
        """Forget every mark (start of a fit, or after a warm-up batch)."""
        self._marks = []
