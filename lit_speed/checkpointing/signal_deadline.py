"""Within a deadline after a stop signal, save the last completed step and exit, even when one step takes longer.

The ordinary stop saves after the batch that was running when the signal came. When that batch (or its
validation) would end after ``deadline_s``, a :class:`DeadlineWatchdog` thread in every process saves instead the
state after the last *completed* optimizer step, which the live tensors still hold until the next update begins
(:class:`~lit_speed.checkpointing.stop_signals.StepGate`), and ends the process with ``128 + signum``.

The processes agree without a collective (a collective could pair with one the main threads are blocked in): over
keys in the run's own TCP store (the one ``torch.distributed`` rendezvoused through), each process says how many
updates it has begun; the cut is the largest count (a process one update behind finishes that update: it already
received its gradients), every process freezes there and writes its part, and rank 0 commits the checkpoint once
every part is written. A process that cannot reach the cut in time leaves the previous checkpoint in place.
"""
from __future__ import annotations

import io
import logging
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from lit_speed.checkpointing.stop_signals import INBOX, Snapshot, StepGate, signal_name

log = logging.getLogger(__name__)

POLL_S = 0.1  # how often a watchdog looks at the inbox and the shared keys
SLACK_S = 1.0  # time kept for the agreement and the exit besides the expected write time
_FITS = [0]  # fits started in this process: every process starts them in the same order, so the keys match


class PeerChannel:
    """Keys the processes of one run share without a collective: a client of the run's TCP store.

    Under Lightning's launcher, ``torchrun`` and the ``deepspeed`` launcher, ``MASTER_ADDR``/``MASTER_PORT`` name the
    store ``torch.distributed`` rendezvoused through (hosted by rank 0 or by torchrun's agent); a second client
    connection of our own is used from the watchdog thread, so the process group's own is never shared.
    """

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size

    @classmethod
    def connect(cls, rank: int, world_size: int, timeout_s: float = 30.0) -> "PeerChannel | None":
        """A channel for this fit (``None`` on one process, or without ``MASTER_ADDR``/``MASTER_PORT``)."""
        if world_size < 2 or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            return None
        from torch.distributed import PrefixStore, TCPStore

        _FITS[0] += 1
        client = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        run = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        return cls(PrefixStore(f"lit_speed/stop/{run}/{_FITS[0]}/", client), rank, world_size)

    def put(self, key: str, value: bytes | str) -> None:
        self.store.set(key, value)

    def has(self, key: str) -> bool:
        return bool(self.store.check([key]))

    def read(self, key: str) -> bytes | None:
        return self.store.get(key) if self.has(key) else None

    def gather(self, name: str, until: float) -> list[bytes] | None:
        """Every rank's ``name/<rank>`` value once all are there; ``None`` if ``until`` (monotonic) passes first."""
        keys = [f"{name}/{r}" for r in range(self.world_size)]
        while not self.store.check(keys):
            if time.monotonic() >= until:
                return None
            time.sleep(POLL_S / 2)
        return [self.store.get(k) for k in keys]


def to_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


class DeadlineWriter(Protocol):
    """How one strategy's checkpoint is written from a snapshot, outside the main thread and without collectives."""

    def write_part(self, snapshot: Snapshot) -> None:
        """This process's share (DeepSpeed: its optimizer shard); called on every rank."""

    def commit(self, snapshot: Snapshot, parts: list[dict[str, Any]]) -> Path:
        """Rank 0, once every rank's part is written: the rest, made visible atomically; returns the checkpoint."""


class DeadlineWatchdog(threading.Thread):
    """After a stop signal anywhere in the run, wait until ``deadline_s`` minus the expected save time, then save
    the last completed step and exit ``128 + signum`` (unless every process is already saving the ordinary way).

    Args:
        deadline_s: Seconds from the signal to the exit the run aims for.
        gate: The main thread's :class:`StepGate`.
        writer: Writes the checkpoint (:class:`DeadlineWriter`).
        rank: This process's global rank.
        world_size: Processes in the run.
        channel: Shared keys (``None`` on one process).
        expected_write_s: Seconds a save is expected to take (measured saves of this run).
        describe: ``describe(step, path, signum)`` -> the line rank 0 prints (how to resume).
        before_exit: Called on rank 0 before the process ends (flush the loggers).
    """

    def __init__(self, deadline_s: float, gate: StepGate, writer: DeadlineWriter, rank: int, world_size: int,
                 channel: PeerChannel | None, expected_write_s: Callable[[], float],
                 describe: Callable[[int, Path | None, int, str], str], before_exit: Callable[[], None]) -> None:
        super().__init__(name="lit_speed-signal-deadline", daemon=True)
        self.deadline_s, self.gate, self.writer = deadline_s, gate, writer
        self.rank, self.world_size, self.channel = rank, world_size, channel
        self.expected_write_s, self.describe, self.before_exit = expected_write_s, describe, before_exit
        self.ended = threading.Event()
        self.fired_at: float | None = None

    def end(self) -> None:
        """Stop watching (the fit ended, or the ordinary stop finished saving)."""
        self.ended.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=5.0)

    def fire_time(self, received_at: float) -> float:
        """When to stop waiting for the step (wall clock): the deadline less the expected save and some slack."""
        return received_at + max(self.deadline_s - self.expected_write_s() - SLACK_S, 0.0)

    # ------------------------------------------------------------------------------------------ the thread
    def run(self) -> None:
        stop = None
        try:
            stop = self._await_stop()
            if stop is not None:
                self._fire(*stop)  # ends the process, or returns when the ordinary stop is saving everywhere
        except Exception as error:  # noqa: BLE001 - before the deadline a watchdog must never take the run down
            if self.fired_at is None:
                log.debug(f"[rank {self.rank}] signal deadline watch ended: {type(error).__name__}: {error}")
                return
            # past the deadline the process must end, whatever failed (a peer gone, a write refused)
            self._exit(stop[0] if stop else 15, None, f"{type(error).__name__}: {error}")

    def _await_stop(self) -> tuple[int, float] | None:
        published = polite_published = False
        while not self.ended.is_set():
            stop = (INBOX.signum, INBOX.received_at) if INBOX.signum is not None else None
            if self.channel is not None:
                if stop is not None and not published:
                    self.channel.put("stop", f"{stop[0]} {stop[1]!r}")
                    published = True
                if self.gate.polite and not polite_published:
                    self.channel.put(f"polite/{self.rank}", "1")
                    polite_published = True
                if stop is None and (remote := self.channel.read("stop")) is not None:
                    signum, at = remote.decode().split()
                    stop = int(signum), float(at)
            if stop is not None and time.time() >= self.fire_time(stop[1]):
                return stop
            self.ended.wait(POLL_S)
        return None

    def _everyone_saving(self) -> bool:
        if self.channel is None:
            return self.gate.polite
        return all(self.channel.has(f"polite/{r}") for r in range(self.world_size))

    def _fire(self, signum: int, received_at: float) -> None:
        self.fired_at = time.time()
        if self._everyone_saving():  # the ordinary stop is under way everywhere: let it finish
            if self.rank == 0:
                log.warning(f"{signal_name(signum)}: the {self.deadline_s:g} s deadline came while saving; waiting for the save")
            return
        until = time.monotonic() + max(received_at + self.deadline_s - time.time(), 0.0)
        begun = self.gate.freeze()
        cut = begun
        if self.channel is not None:
            self.channel.put(f"cut/{self.rank}", str(begun))
            counts = self.channel.gather("cut", until)
            if counts is None:
                return self._exit(signum, None, "another process did not answer in time")
            cut = max(int(c) for c in counts)
        snapshot = self.gate.advance_to(cut, until - time.monotonic()) if cut > 0 else None
        if cut > 0 and snapshot is None:
            return self._exit(signum, None, f"this process did not finish optimizer update {cut} in time")
        if snapshot is None:
            return self._exit(signum, None, "no optimizer step had completed in this run yet")
        self.writer.write_part(snapshot)
        if self.channel is None:
            return self._exit(signum, self.writer.commit(snapshot, [snapshot.rank_part]), None, snapshot.step)
        self.channel.put(f"part/{self.rank}", to_bytes(snapshot.rank_part))
        if self.rank != 0:
            committed = self._wait_key("committed", until + 2 * self.expected_write_s() + 10.0)
            self.channel.put(f"exiting/{self.rank}", "1")  # rank 0 may host the store: it waits for this
            return self._exit(signum, None, None if committed else "rank 0 did not commit in time", snapshot.step)
        parts = self.channel.gather("part", until + 2 * self.expected_write_s() + 10.0)
        if parts is None:
            return self._exit(signum, None, "another process did not write its part in time")
        path = self.writer.commit(snapshot, [from_bytes(p) for p in parts])
        self.channel.put("committed", str(path))
        self.channel.put("exiting/0", "1")
        self.channel.gather("exiting", time.monotonic() + 3.0)  # the others have read "committed"
        self._exit(signum, path, None, snapshot.step)

    def _wait_key(self, key: str, until: float) -> bool:
        while self.channel is not None and not self.channel.has(key):
            if time.monotonic() >= until:
                return False
            time.sleep(POLL_S / 2)
        return True

    def _exit(self, signum: int, path: Path | None, problem: str | None, step: int = 0) -> None:
        if self.rank == 0:
            try:
                self.before_exit()
            except Exception as error:  # noqa: BLE001 - the exit must happen
                log.error(f"signal deadline: could not flush the loggers: {error}")
            line = self.describe(step, path, signum, problem or "")
            (log.error if problem else log.warning)(line)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        logging.shutdown()
        os._exit(128 + int(signum))
