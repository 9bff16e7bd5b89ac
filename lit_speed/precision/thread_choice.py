"""The intra-op thread count of a run: left to torch, set, or timed on the model's first training batch.

On a CPU the best thread count for a small model is not always "all cores": synchronising threads costs more
than a small matmul gains, and the break-even point depends on the CPU and the model. ``threads="auto"`` times
the user's own step at 1, 2, 4, ... up to this process's share of the cores (:func:`~lit_speed.precision.
step_timing.choose_threads`, cached per machine) and keeps the fastest. :class:`GuardedPrecision` owns the first
batch, so it asks this helper before it times the precision modes (whose timings are then taken at the chosen
count). The choice goes into the checkpoint and a resume reuses it.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch
from lightning.pytorch.utilities import rank_zero_info

from lit_speed.data.pipeline import available_cores  # a shared module: the one home of this fact
from lit_speed.tuning import on_rank_zero


class ThreadChoice:
    """``threads``: ``None`` (torch's count), an int from 1 to the cores this process may run on, or ``"auto"``.

    Raises:
        ValueError: Any other value, naming the setting (and the cores, for a count above them).
    """

    def __init__(self, threads: int | str | None) -> None:
        if not (threads is None or threads == "auto" or (isinstance(threads, int) and threads >= 1)):
            raise ValueError(f"GuardedPrecision(threads={threads!r}): threads must be an int >= 1, 'auto' or None "
                             f"(torch's count), got {threads!r}")
        cores = available_cores()
        if isinstance(threads, int) and threads > cores:
            raise ValueError(f"GuardedPrecision(threads={threads}): more than the {cores} CPU core(s) this process may "
                             "run on (os.sched_getaffinity); threads beyond the cores wait for each other and slow "
                             f"every step. Fix: threads={cores} (or fewer), threads=auto (timed on your step), or "
                             "None (torch's count)")
        self.requested = threads
        self.chosen: int | None = threads if isinstance(threads, int) else None
        self.reason = "requested" if self.chosen is not None else "torch's default"
        self.pending = threads == "auto"  # timed on the first training batch

    def apply_fixed(self) -> None:
        """Set a requested or restored count (at setup). In a deterministic run (``torch.
        use_deterministic_algorithms``: Lightning's ``deterministic=True``) torch's own count is set too: only
        ``torch.set_num_threads`` turns MKL's dynamic threads off (``MKL_DYNAMIC``, on by default), and a thread
        count MKL cannot change at run time is its first condition for the same float sums from run to run
        (Intel oneMKL guide, "Reproducibility Conditions")."""
        if self.chosen is not None:
            torch.set_num_threads(self.chosen)
        elif torch.are_deterministic_algorithms_enabled():
            torch.set_num_threads(torch.get_num_threads())

    def decide(self, trainer: Any, batch: Any, mode: str) -> None:
        """``threads="auto"``: rank 0 times the step at each candidate count, every rank uses its choice."""
        from lit_speed.precision.step_timing import choose_threads, thread_candidates

        def time_it() -> Any:
            counts = thread_candidates(os.cpu_count() or 1, int(os.environ.get("LOCAL_WORLD_SIZE",
                                                                               trainer.num_devices or 1)))
            return choose_threads(trainer.lightning_module, batch, mode, counts, trainer.strategy.root_device)

        self.pending = False
        kept = torch.get_num_threads()
        chosen, self.reason = on_rank_zero(lambda: timed_or_kept(time_it, kept, "kept"), trainer)
        self.chosen = int(chosen)
        torch.set_num_threads(self.chosen)
        rank_zero_info(f"GuardedPrecision: threads=auto -> {self.chosen} ({self.reason})")

    def describe(self) -> str:
        if self.pending:
            return "auto: times this model's step at 1..cores intra-op threads on the first training batch"
        return f"{self.chosen if self.chosen is not None else torch.get_num_threads()} ({self.reason})"

    def state_dict(self) -> dict[str, Any]:
        return {"threads": self.chosen, "threads_reason": self.reason} if self.chosen is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resume keeps the checkpoint's count when this run asks for ``auto`` (not timed again)."""
        if self.requested == "auto" and state.get("threads") is not None:
            self.chosen, self.pending = int(state["threads"]), False
            self.reason = f"restored from the checkpoint (not timed again): {state.get('threads_reason', '')}"
            torch.set_num_threads(self.chosen)


def timed_or_kept(time_it: Callable[[], Any], kept: Any, kept_why: str) -> tuple[Any, str]:
    """``(chosen, reason)`` of ``time_it()`` (a :class:`~lit_speed.tuning.Decision`); a step the timer cannot run
    keeps ``kept``, its reason ``"<kept_why>: could not time the step (<error type>)"``. Called through
    :func:`~lit_speed.tuning.on_rank_zero`: rank 0 times, every rank gets its answer."""
    try:
        decision = time_it()
    except Exception as error:  # noqa: BLE001 - a step this timer cannot run: keep what the run has
        return kept, f"{kept_why}: could not time the step ({type(error).__name__})"
    return decision.chosen, decision.reason
