"""A stop signal (SIGTERM, SIGUSR1) is only recorded where it lands; the processes of a run agree on where to stop.

Lightning 2.6.6's SIGTERM handler runs a ``dist.broadcast`` inside the signal handler and forwards the signal to
the launcher's children (:mod:`lit_speed.compat.lightning_loops`). A collective started from a handler pairs with
whatever collective the other process runs next, and both wait forever. Here the handler only writes down the
signal and the time
(:data:`INBOX`); at the end of every training batch (a point all processes reach in the same order) one
all-reduce tells every process whether any of them was signalled, and all stop after that same batch.

:class:`StepGate` is the other half: it tracks whether the live weights and optimizer state are those of the last
completed optimizer step (until the next update begins they are), so that a watchdog thread can save that state
while a long step is still running (:mod:`lit_speed.checkpointing.signal_deadline`).
"""
from __future__ import annotations

import copy
import math
import signal
import threading
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Iterable

import torch

STOP_SIGNALS = ("SIGTERM", "SIGUSR1")


class SignalInbox:
    """The first stop signal this process received, and when (``time.time()``). A handler that only records."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.received_at: float | None = None
        self.event = threading.Event()

    def note(self, signum: int, received_at: float | None = None) -> None:
        """Record ``signum`` (only the first one counts; a second signal changes nothing)."""
        if self.signum is None:
            self.signum, self.received_at = int(signum), time.time() if received_at is None else received_at
        self.event.set()

    def handler(self, signum: int, frame: FrameType | None = None) -> None:
        """A ``signal.signal`` handler: record, nothing else (no collective, no I/O, no exception)."""
        self.note(signum)

    def clear(self) -> None:
        """Forget the signal (a new fit in the same process starts clean)."""
        self.signum, self.received_at = None, None
        self.event.clear()


#: The one inbox of this process: every handler installed here writes to it.
INBOX = SignalInbox()


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def record_stop_signals(names: Iterable[str] = STOP_SIGNALS) -> list[str]:
    """Make the named signals only record into :data:`INBOX` from now on, in the main thread (a no-op elsewhere).

    Called at the start of ``scripts/train.py`` in every process of a run (Lightning's launcher, ``torchrun`` and
    the ``deepspeed`` launcher all start that script), so a signal that comes while the run starts up is kept for
    the first training batch to act on instead of killing the process (and leaving its peers waiting). SIGUSR1 is
    left alone under SLURM with Lightning's auto-requeue (its handler saves and requeues the job). Returns the
    names of the signals now recorded.
    """
    if threading.current_thread() is not threading.main_thread():
        return []
    recorded = []
    for name in names:
        signum = getattr(signal, name, None)
        if signum is None or (name == "SIGUSR1" and _slurm_requeues()):
            continue
        signal.signal(signum, INBOX.handler)
        recorded.append(name)
    return recorded


def _slurm_requeues() -> bool:
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return SLURMEnvironment.detect()


def record_signal_if_unhandled(signum: int) -> bool:
    """Make ``signum`` record into :data:`INBOX` unless another handler (e.g. Lightning's SLURM requeue one) has it."""
    if threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(signum)
    if current is INBOX.handler or current not in (None, signal.SIG_DFL):
        return current is INBOX.handler
    signal.signal(signum, INBOX.handler)
    return True


# ---------------------------------------------------------------------------------------------- snapshots
def storage_ids(tensors: Iterable[torch.Tensor]) -> set[int]:
    """The storages ``tensors`` live in (a view shares its base's)."""
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor) and t.numel()}


_ATOMS = (int, float, str, bytes, bool, type(None))


def keep_live_copy_rest(obj: Any, live: set[int]) -> Any:
    """A copy of ``obj`` (nested dicts, lists, tuples) in which every tensor stored in ``live`` storage (weights,
    optimizer state: they change only in an optimizer update) is the same tensor, and every other tensor (buffers
    such as BatchNorm statistics, metric states, RNG states: they change during forward) is cloned."""
    if isinstance(obj, _ATOMS):
        return obj
    if isinstance(obj, torch.Tensor):
        if obj.numel() and obj.untyped_storage().data_ptr() in live:
            return obj
        return obj.detach().clone()
    if isinstance(obj, (list, tuple)) and all(isinstance(v, _ATOMS) for v in obj):  # e.g. Python's RNG state
        return list(obj) if isinstance(obj, list) else obj
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for key, value in obj.items():
            out[key] = keep_live_copy_rest(value, live)
        return out
    if isinstance(obj, list):
        return [keep_live_copy_rest(v, live) for v in obj]
    if isinstance(obj, tuple):
        items = [keep_live_copy_rest(v, live) for v in obj]
        return tuple(items) if type(obj) is tuple else type(obj)(*items)
    return copy.deepcopy(obj)


@dataclass
class Snapshot:
    """The run's state after ``updates`` optimizer updates of this fit, taken where every process stops.

    Attributes:
        updates: Optimizer updates begun by then (all complete).
        step: ``trainer.global_step`` then.
        checkpoint: What ``Trainer.save_checkpoint`` would have written (weights and optimizer state are the live
            tensors, valid until the next update begins; the rest copied).
        rank_part: This process's RNG and metric states (:func:`lit_speed.checkpointing.run_state.rank_part`).
        extra: Strategy-specific pieces (DeepSpeed: the module's state dict).
    """

    updates: int
    step: int
    checkpoint: dict[str, Any] | None
    rank_part: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- the gate
class StepGate:
    """Whether the live training state is the last snapshot's, and the lock that keeps it so.

    The main thread calls :meth:`before_update` right before an optimizer update (``on_before_optimizer_step``) and
    :meth:`consistent` once the step is complete; between the two the weights are changing (phase ``updating``),
    elsewhere they are the snapshot's (``consistent``). A watchdog thread :meth:`freeze`\\ s the gate (no new
    update begins), may let the main thread go on to a given update count (:meth:`advance_to`, so that every
    process stops at the same step), and then owns the state: the main thread waits in :meth:`hold` from its next
    safe point on (after the snapshot, before a save, before the stop agreement).
    """

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.updates = 0
        self.updating = False
        self.allowed = math.inf
        self.snapshot: Snapshot | None = None
        self.taken_over = False
        self.polite = False  # the main thread began the ordinary stop: saving after the agreed batch

    # -- main thread
    def before_update(self) -> None:
        with self.cv:
            while self.updates + 1 > self.allowed:
                self.cv.wait()
            self.updates += 1
            self.updating = True

    def consistent(self, snapshot: Snapshot | None) -> None:
        with self.cv:
            if snapshot is not None:
                self.snapshot = snapshot
            self.updating = False
            self.cv.notify_all()
        self.hold()

    def hold(self) -> None:
        """Wait here for good once a watchdog owns the state and this process has reached the step it saves."""
        with self.cv:
            while self.taken_over and not self.updating and self.updates >= self.allowed:
                self.cv.wait()

    def begin_polite_save(self) -> None:
        self.hold()
        with self.cv:
            self.polite = True

    # -- watchdog thread
    def freeze(self) -> int:
        """No new update begins; returns the updates begun so far (the one in flight, if any, completes)."""
        with self.cv:
            self.taken_over = True
            self.allowed = self.updates
            self.cv.notify_all()
            return self.updates

    def advance_to(self, updates: int, timeout: float) -> Snapshot | None:
        """Let the main thread complete ``updates`` updates, wait (at most ``timeout`` s) until it has and the state
        is consistent; returns the snapshot of that point (``None``: not reached in time, or no update this fit)."""
        deadline = time.monotonic() + max(timeout, 0.0)
        with self.cv:
            self.allowed = max(self.allowed, updates)
            self.cv.notify_all()
            while self.updating or self.updates < updates:
                left = deadline - time.monotonic()
                if left <= 0 or not self.cv.wait(left):
                    if self.updating or self.updates < updates:
                        return None
            snap = self.snapshot
        return snap if snap is not None and snap.updates == updates else None
