"""The intra-op thread count of a run: left to torch, set, or timed on the model's first training steps.

On a CPU the best thread count for a small model is not always "all cores": synchronising threads costs more
than a small matmul gains, and the break-even point depends on the CPU and the model. ``threads="auto"`` times
the user's own step at 1, 2, 4, ... up to this process's share of the cores and keeps the fastest (cached per
machine; the choice goes into the checkpoint and a resume reuses it).

Where it times: a single-process run that is not deterministic times **the run's own first optimizer steps**
(:class:`StepTrial`): each count trains whole optimizer steps in turn, the first step of each count is its warm-up,
and after 3-6 rounds the fastest count trains the rest of the run. Nothing is copied and no step is thrown away; the
trial costs the slower counts' extra time on its few steps. A trial that ran while other processes kept cores busy
runs again :data:`RETIME_AFTER` steps later (up to :data:`RETIMES` times); the quiet one decides. Copies of the model
timed apart took 0.5-1.2 s of a ~30 s charlm_fast run on a Zen4 (2 threads 44 ms a step, 1 thread 64 ms), and a copy
of a model and its optimizer per count at real size. A deterministic run (Lightning's ``deterministic=True``), a run
of several processes and a GPU run time copies before the first step
(:func:`~lit_speed.precision.step_timing.choose_threads`): every step of a deterministic run uses one count (MKL's
sums depend on it), the ranks decide together, and a GPU step's time is only known after a synchronisation, which the
copies make and the run does not. The precision modes and the attention kernel (``auto``) are timed at the first
batch, before the trial, at the count in use then; a deterministic, multi-process or GPU run times its count first.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch
from lightning.pytorch.utilities import rank_zero_info

from lit_speed.data.pipeline import available_cores  # a shared module: the one home of this fact
from lit_speed.tuning import on_rank_zero
from lit_speed.tuning.machine_cache import OtherLoad
from lit_speed.tuning.measured_choice import SEPARATED_AFTER, cached_choice, recorded_choice, separated

#: :class:`StepTrial` decides after at most this many rounds (one optimizer step per count each), sooner once the
#: counts are separated (after :data:`~lit_speed.tuning.measured_choice.SEPARATED_AFTER` rounds).
TRIAL_ROUNDS = 6
#: A trial that ran while other processes kept cores busy (:class:`~lit_speed.tuning.machine_cache.OtherLoad`, CPU
#: steal included) is run again this many optimizer steps after it ended, up to :data:`RETIMES` times, until one runs
#: on a quiet machine: beside a busy core one thread wins (Z4: a 2-thread step 322 ms, 1 thread 91 ms), and a
#: neighbour's burst during the first steps must not set the count of a whole run (that run took 43.9 s, its peers 33).
RETIME_AFTER = 50
RETIMES = 3


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
        self.pending = threads == "auto"  # decided on the first training batch
        self.trial: StepTrial | None = None  # auto: the counts being timed on the run's own steps
        self.retime: tuple[int, StepTrial] | None = None  # (optimizer step, busy trial): timed again from that step
        self.retimes = 0

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
        """``threads="auto"`` at the first training batch: this machine's cached choice, else a :class:`StepTrial` on
        the run's own steps (one process on the CPU, not deterministic), else rank 0 times copies of the step at each
        count and every rank uses its choice."""
        from lit_speed.precision.step_timing import as_step_input, choose_threads, step_key, thread_candidates

        self.pending = False
        kept = torch.get_num_threads()
        counts = thread_candidates(os.cpu_count() or 1, int(os.environ.get("LOCAL_WORLD_SIZE",
                                                                           trainer.num_devices or 1)))
        on_run = trainer.world_size == 1 and trainer.strategy.root_device.type == "cpu" and len(set(counts)) > 1
        if on_run and not torch.are_deterministic_algorithms_enabled():
            module = trainer.lightning_module
            key = {**step_key(module, mode, as_step_input(module, batch, trainer.strategy.root_device)),
                   "on_run": True, "threads": kept}  # the starting count: the trial's own switches are not in its key
            order = [str(n) for n in sorted(set(counts) | {kept}, key=lambda n: n != kept)]  # the count in use first
            cached = cached_choice(NAME, key, order, str(kept))
            if cached is None:
                self.trial = StepTrial(order, key)
                rank_zero_info(f"GuardedPrecision: threads=auto times {', '.join(order)} threads on this run's first "
                               "optimizer steps (each count in turn; no copy of the model)")
                return
            self._take(cached.chosen, cached.reason)
            return

        def time_it() -> Any:
            return choose_threads(trainer.lightning_module, batch, mode, counts, trainer.strategy.root_device)

        self._take(*on_rank_zero(lambda: timed_or_kept(time_it, kept, "kept"), trainer))

    @property
    def watching(self) -> bool:
        """Whether :meth:`on_batch` is wanted: a trial runs, or one is due again (:data:`RETIME_AFTER`)."""
        return self.trial is not None or self.retime is not None

    def on_batch(self, global_step: int) -> None:
        """Every training batch while :attr:`watching` (``GuardedPrecision.convert_input``)."""
        if self.retime is not None and global_step >= self.retime[0]:
            busy, self.retime = self.retime[1], None
            order = [str(self.chosen)] + [n for n in busy.order if n != str(self.chosen)]  # the count in use first
            self.trial = StepTrial(order, busy.key, first_step=global_step)
            rank_zero_info(f"GuardedPrecision: threads=auto times {', '.join(order)} threads again from optimizer step "
                           f"{global_step}: the last trial ran while other processes kept {busy.load.cores:.1f} of "
                           f"{os.cpu_count()} cores busy")
        if self.trial is not None and self.trial.on_batch(global_step):
            self.finish(global_step)

    def finish(self, global_step: int | None = None) -> None:
        """Decide a running trial from the rounds it has (at the trial's end, or when the run ends during it: no
        ``global_step``); one that ran beside other load is due again :data:`RETIME_AFTER` steps later."""
        trial, self.trial = self.trial, None
        if trial is None:
            return
        self._take(*trial.decide())
        if global_step is not None and trial.load.busy and self.retimes < RETIMES:
            self.retimes += 1
            self.retime = (global_step + RETIME_AFTER, trial)

    def _take(self, chosen: Any, reason: str) -> None:
        self.chosen, self.reason = int(chosen), reason
        torch.set_num_threads(self.chosen)
        rank_zero_info(f"GuardedPrecision: threads=auto -> {self.chosen} ({self.reason})")

    def describe(self) -> str:
        if self.pending or self.trial is not None:
            return ("auto: times this model's step at 1..cores intra-op threads on the run's first optimizer steps "
                    "(copies of the step in a deterministic, multi-process or GPU run)")
        return f"{self.chosen if self.chosen is not None else torch.get_num_threads()} ({self.reason})"

    def state_dict(self) -> dict[str, Any]:
        if self.chosen is None:
            return {}
        busy = self.retime is not None or (self.trial is not None and self.trial.first_step > 0)
        return {"threads": self.chosen, "threads_reason": self.reason, **({"threads_busy": True} if busy else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resume keeps the checkpoint's count when this run asks for ``auto`` (not timed again), unless a trial
        beside other load chose it: then this run decides as a fresh one does, from torch's count (the same cache key,
        so a quiet answer cached since is found, and a quiet trial here is found by later runs)."""
        if self.requested == "auto" and state.get("threads") is not None and not state.get("threads_busy"):
            self.chosen, self.pending = int(state["threads"]), False
            self.reason = f"restored from the checkpoint (not timed again): {state.get('threads_reason', '')}"
            torch.set_num_threads(self.chosen)


NAME = "precision.threads"


class StepTrial:
    """``threads=auto`` timed on the run's own optimizer steps: each count in ``order`` trains one optimizer step in
    turn (the first round is the warm-up; then the order rotates every round), timed from the first batch of the
    step to the first batch of the next (gradient accumulation, data loading and callbacks included, per batch).
    Decided after :data:`TRIAL_ROUNDS` timed rounds, or once :func:`~lit_speed.tuning.measured_choice.separated`
    after :data:`~lit_speed.tuning.measured_choice.SEPARATED_AFTER`; the count in use at the start is kept unless
    another is faster by the tuning margin, and the timings are cached per machine like every measured choice."""

    def __init__(self, order: list[str], key: dict[str, Any], first_step: int = 0) -> None:
        self.order, self.key, self.first_step = order, key, first_step
        self.samples: dict[str, list[float]] = {n: [] for n in order}
        self.windows = 0  # optimizer steps finished in the trial
        self.step: int | None = None  # the global step the current window started at
        self.start = 0.0
        self.batches = 0
        self.load = OtherLoad().__enter__()

    def count(self, window: int) -> str:
        n = len(self.order)
        rnd, i = divmod(window, n)
        return self.order[(i + max(rnd - 1, 0)) % n]  # round 0 is the warm-up in order; then rotating rounds

    def rounds(self) -> int:
        return max(self.windows // len(self.order) - 1, 0)

    def on_batch(self, global_step: int) -> bool:
        """Called before every training batch; True when the trial is over."""
        now = time.perf_counter()
        if self.step is not None and global_step == self.step:
            self.batches += 1
            return False
        if self.step is not None:  # an optimizer step ended: its time per batch goes to its count
            if self.windows >= len(self.order):
                self.samples[self.count(self.windows)].append((now - self.start) / self.batches)
            self.windows += 1
            done = self.rounds() >= TRIAL_ROUNDS or (self.rounds() >= SEPARATED_AFTER and self.windows % len(
                self.order) == 0 and separated(self.samples))
            if done:
                return True
        torch.set_num_threads(int(self.count(self.windows)))
        self.step, self.start, self.batches = global_step, now, 1
        return False

    def decide(self) -> tuple[str, str]:
        self.load.__exit__(None, None, None)
        steps = self.windows
        if self.rounds() < 2:  # the run ended before two timed rounds (copies of the step are timed two at least)
            return self.order[0], f"kept: the run ended during the trial ({steps} optimizer steps)"
        how = (f"timed on this run's first {steps} optimizer steps" if not self.first_step else
               f"timed again on this run's optimizer steps {self.first_step}-{self.first_step + steps - 1}")
        decision = recorded_choice(NAME, self.key, self.samples, self.order[0], self.load, how)
        return decision.chosen, decision.reason


def timed_or_kept(time_it: Callable[[], Any], kept: Any, kept_why: str) -> tuple[Any, str]:
    """``(chosen, reason)`` of ``time_it()`` (a :class:`~lit_speed.tuning.Decision`); a step the timer cannot run
    keeps ``kept``, its reason ``"<kept_why>: could not time the step (<error type>)"``. Called through
    :func:`~lit_speed.tuning.on_rank_zero`: rank 0 times, every rank gets its answer."""
    try:
        decision = time_it()
    except Exception as error:  # noqa: BLE001 - a step this timer cannot run: keep what the run has
        return kept, f"{kept_why}: could not time the step ({type(error).__name__})"
    return decision.chosen, decision.reason
