"""A stop signal seen when it arrives, not when the main thread next runs Python.

CPython runs a ``signal.signal`` handler in the main thread, between bytecodes: while the main thread is inside one
long C call (the backward pass of a large model: a minute on a CPU), the handler waits for it, and so did
:data:`~lit_speed.checkpointing.stop_signals.INBOX`'s record of the signal and with it the deadline of
``FaultTolerance(signal_deadline_s)``: a signal that came early in a long step was recorded when the step ended,
past a deadline shorter than the step. The interpreter's C-level handler runs at once, in whichever thread
the kernel picks, and writes the signal's number to the wake-up file descriptor (``signal.set_wakeup_fd``): a daemon
thread reading that pipe records the signal and the time it came, and the deadline's watchdog thread acts on it while
the main thread is still in C. The Python handler still runs later; :class:`SignalInbox` keeps the first record.

A process has one wake-up fd. One already taken (an ``asyncio`` loop running in the main thread) is left to its
owner: the signal is then recorded by the Python handler, as before. A process forked from this one (a DataLoader
worker) drops the wake-up fd, so a signal to a worker is not taken for one to the run.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Iterable

from lit_speed.checkpointing.stop_signals import INBOX

#: the signals recorded from the wake-up fd: only those whose Python handler records into INBOX (never SIGINT, or
#: Lightning's SLURM requeue handler's SIGUSR1)
WATCHED: set[int] = set()
_PIPE: dict[str, int] = {"read": -1, "write": -1}
_THREAD: list[threading.Thread] = []


def watch_stop_signals(signums: Iterable[int]) -> bool:
    """Record ``signums`` in INBOX the moment they arrive (call from the main thread; idempotent). Returns whether the
    wake-up fd is this module's (``False``: another owner holds it, or this is not the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if _PIPE["write"] < 0:
        _PIPE["read"], _PIPE["write"] = os.pipe()
        os.set_blocking(_PIPE["write"], False)  # the C handler must never block on it
    previous = signal.set_wakeup_fd(_PIPE["write"], warn_on_full_buffer=False)
    if previous not in (-1, _PIPE["write"]):
        signal.set_wakeup_fd(previous)  # someone else's (asyncio): theirs to keep
        return False
    WATCHED.update(int(s) for s in signums)
    if not _THREAD:
        thread = threading.Thread(target=_record_from, args=(_PIPE["read"],), name="lit_speed-signal-wakeup",
                                  daemon=True)
        thread.start()
        _THREAD.append(thread)
    return True


def _record_from(read_fd: int) -> None:
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            return
        now = time.time()
        for signum in data:
            if signum in WATCHED:
                INBOX.note(signum, now)


def _forget_in_child() -> None:
    """In a forked child (no watcher thread there): drop the wake-up fd and the pipe's ends."""
    if _PIPE["write"] < 0:
        return
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:  # forked from another thread than the main one: the fd stays (closing it would let its
        return          # number be reused while the C handler still writes to it)
    for end in ("read", "write"):
        try:
            os.close(_PIPE[end])
        except OSError:
            pass
        _PIPE[end] = -1
    _THREAD.clear()
    WATCHED.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
