"""Measured choices: the decision rule, the interleaved timer and the per-machine cache (no timing asserted)."""
from __future__ import annotations

import importlib
import json

import pytest

from lit_speed.tuning import choose_fastest, measured_choice, time_interleaved
from lit_speed.tuning.machine_cache import cache_dir, machine_key


def test_the_default_is_kept_unless_another_candidate_is_clearly_faster():
    assert choose_fastest({"a": 1.0, "b": 0.99}, default="a", min_gain=0.03)[0] == "a"
    assert choose_fastest({"a": 1.0, "b": 0.90}, default="a", min_gain=0.03)[0] == "b"
    assert choose_fastest({"a": 0.5, "b": 0.90}, default="b")[0] == "a"  # the default itself is slower


def test_a_candidate_that_could_not_run_is_never_chosen_and_the_reason_shows_every_time():
    chosen, reason = choose_fastest({"a": 2e-3, "b": None}, default="b")
    assert chosen == "a" and "a 2.00 ms" in reason and "b could not run" in reason
    assert choose_fastest({"a": None, "b": None}, default="b") == ("b", "no candidate could run (a could not run, "
                                                                        "b could not run): kept the default")


def test_the_default_must_be_a_candidate():
    with pytest.raises(ValueError, match=r"default must be one of the candidates \['a'\], got 'c'"):
        choose_fastest({"a": 1.0}, default="c")


def test_interleaved_timing_rotates_the_order_and_drops_a_candidate_that_raises():
    calls: list[str] = []

    def broken():
        raise RuntimeError("no kernel here")

    samples = time_interleaved({"x": lambda: calls.append("x"), "y": lambda: calls.append("y"), "z": broken},
                               rounds=4, budget_s=60)
    assert samples["z"] is None and len(samples["x"]) == len(samples["y"]) == 4
    assert calls == ["x", "y", "x", "y", "y", "x", "x", "y", "y", "x"]  # warm-ups, then rotated rounds


def test_a_choice_is_timed_once_per_machine_and_key_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LIT_SPEED_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LIT_SPEED_AUTO_CACHE", raising=False)
    runs = {"slow": 0, "fast": 0}

    def candidate(name):
        def run():
            runs[name] += 1
        return run

    first = measured_choice("test.kernel", {"shape": [3]}, {n: candidate(n) for n in runs}, default="slow",
                            rounds=3)
    assert first.cached_on is None and sum(runs.values()) == 2 * (1 + 3)
    stored = json.loads((cache_dir() / "test.kernel.json").read_text())
    (key, entry), = stored.items()
    assert json.loads(key)["hardware"] == machine_key()["hardware"] and set(entry["times"]) == {"slow", "fast"}

    again = measured_choice("test.kernel", {"shape": [3]}, {n: candidate(n) for n in runs}, default="slow")
    assert sum(runs.values()) == 8 and again.chosen == first.chosen and again.cached_on == entry["when"]
    assert "cached" in again.reason
    measured_choice("test.kernel", {"shape": [4]}, {n: candidate(n) for n in runs}, default="slow", rounds=3)
    assert sum(runs.values()) == 16  # another key: timed again


def test_the_cache_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("LIT_SPEED_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("LIT_SPEED_AUTO_CACHE", "0")
    measured_choice("test.kernel", {}, {"a": lambda: None, "b": lambda: None}, default="a", rounds=2)
    assert not (tmp_path / "test.kernel.json").exists()


def test_an_unwritable_cache_folder_is_said_once_per_process(monkeypatch, tmp_path):
    # issue 50: said for every timed choice (peft.base_compute, then peft.up_grad, ...); the run goes on either way
    import warnings

    from lit_speed.tuning import machine_cache

    blocked = tmp_path / "a_file"
    blocked.write_text("")  # a folder that cannot be made: a file has its name
    monkeypatch.setattr(machine_cache, "_UNWRITABLE", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        machine_cache.write_entry(blocked / "peft.base_compute.json", "k", {"v": 1}, "peft.base_compute")
        machine_cache.write_entry(blocked / "peft.up_grad.json", "k", {"v": 1}, "peft.up_grad")
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and said[0].startswith(f"the timing cache {blocked} cannot be written (peft.base_compute: ")
    assert "the run goes on" in said[0] and said[0].endswith("Fix: set LIT_SPEED_CACHE_DIR to a writable folder, or "
                                                           "LIT_SPEED_AUTO_CACHE=0.")


def test_interleaved_timing_stops_once_the_rounds_have_separated_the_candidates(monkeypatch):
    """A clear case (e.g. 1 thread at 77 ms a step against 2 at 49) needs no tenth round: after three rounds in which
    every call of one candidate beat every call of the other, more rounds could not change the choice."""
    mc = importlib.import_module("lit_speed.tuning.measured_choice")  # the module (the package exports the function)
    clock = [0.0]
    cost = {"fast": 0.049, "slow": 0.077, "close": 0.0495}
    monkeypatch.setattr(mc.time, "perf_counter", lambda: clock[0])

    def candidate(name):
        def run():
            clock[0] += cost[name]
        return run

    clear = time_interleaved({n: candidate(n) for n in ("fast", "slow")}, rounds=10, budget_s=60)
    assert len(clear["fast"]) == len(clear["slow"]) == mc.SEPARATED_AFTER
    close = time_interleaved({n: candidate(n) for n in ("fast", "close")}, rounds=10, budget_s=60)
    assert len(close["fast"]) == len(close["close"]) == 10  # 1% apart: inside the margin, every round is run
    assert mc.separated({"a": [1.0, 1.1], "b": [1.2, 1.3]}) and not mc.separated({"a": [1.0, 1.25], "b": [1.2, 1.3]})

    def broken():
        raise RuntimeError("no kernel here")

    assert time_interleaved({"x": broken, "y": broken}, rounds=10, budget_s=60) == {"x": None, "y": None}


def test_a_timing_taken_beside_other_busy_processes_is_used_but_not_cached(tmp_path, monkeypatch):
    """Beside a busy core, 2 threads timed 1.3 s a step against 1 thread's 0.08 s: the run uses that answer, the
    cache does not keep it (the next run, maybe quiet, times again), and the reason is said once."""
    from lit_speed.tuning import machine_cache

    monkeypatch.setenv("LIT_SPEED_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LIT_SPEED_AUTO_CACHE", raising=False)
    monkeypatch.setenv("LIT_SPEED_BUSY_CORES", "0.25")
    monkeypatch.setattr(machine_cache, "BUSY_MIN_WALL_S", 0.0)  # the fake calls take microseconds
    monkeypatch.setattr(machine_cache, "_SAID_BUSY", set())
    clock = {"machine": 0.0, "own": 0.0}
    monkeypatch.setattr(machine_cache, "_machine_busy_s", lambda: clock["machine"])
    monkeypatch.setattr(machine_cache, "_own_cpu_s", lambda: clock["own"])

    def candidate(own: float, others: float):
        def run():
            clock["own"] += own
            clock["machine"] += own + others
        return run

    busy = {"a": candidate(0.01, 0.05), "b": candidate(0.02, 0.05)}  # others: 5 core-ms a ms of our wall time
    with pytest.warns(UserWarning, match=r"test\.busy was timed while other processes kept .* cores busy: its choice "
                                         r"is used for this run and not cached"):
        first = measured_choice("test.busy", {}, busy, default="b", rounds=2)
    assert first.cached_on is None and not (tmp_path / "test.busy.json").exists()
    quiet = {"a": candidate(0.01, 0.0), "b": candidate(0.02, 0.0)}
    measured_choice("test.busy", {}, quiet, default="b", rounds=2)
    assert (tmp_path / "test.busy.json").exists()  # quiet: cached
    assert measured_choice("test.busy", {}, quiet, default="b").cached_on is not None


def test_the_load_of_a_timing_too_short_for_the_cpu_counters_is_not_judged(monkeypatch):
    """The kernel's counters tick every 10 ms: over a 3 ms timing one tick reads as 6.7 busy cores."""
    from lit_speed.tuning import machine_cache

    monkeypatch.setenv("LIT_SPEED_BUSY_CORES", "0.25")
    ticks = iter([0.0, 0.02])
    monkeypatch.setattr(machine_cache, "_machine_busy_s", lambda: next(ticks))
    monkeypatch.setattr(machine_cache, "_own_cpu_s", lambda: 0.0)
    with machine_cache.OtherLoad() as load:
        pass
    assert load.cores > 1 and not load.busy


def test_samples_timed_elsewhere_are_chosen_and_cached_like_a_timing_here(tmp_path, monkeypatch):
    # threads=auto times the run's own steps, then records them: the next run finds them without timing
    from types import SimpleNamespace

    from lit_speed.tuning.measured_choice import cached_choice, recorded_choice

    monkeypatch.setenv("LIT_SPEED_CACHE_DIR", str(tmp_path))
    assert cached_choice("test.steps", {"k": 1}, ["1", "2"], default="2") is None
    busy = SimpleNamespace(busy=True, cores=1.0)
    with pytest.warns(UserWarning, match=r"test\.steps was timed while other processes kept 1\.0 of"):
        decision = recorded_choice("test.steps", {"k": 1}, {"1": [0.08, 0.09], "2": [0.05, 0.06]}, "2", busy,
                                   "timed on this run's first 4 steps")
    assert decision.chosen == "2" and decision.reason == "timed on this run's first 4 steps: 1 85.00 ms, 2 55.00 ms"
    assert cached_choice("test.steps", {"k": 1}, ["1", "2"], default="2") is None, "a busy machine's samples cached"
    quiet = SimpleNamespace(busy=False, cores=0.0)
    recorded_choice("test.steps", {"k": 1}, {"1": [0.04], "2": [0.05, 0.06]}, "2", quiet, "timed on its steps")
    again = cached_choice("test.steps", {"k": 1}, ["2", "1"], default="2")
    assert again is not None and again.chosen == "1" and again.times == {"1": 0.04, "2": 0.055}
    assert "(cached " in again.reason and cached_choice("test.steps", {"k": 2}, ["1", "2"], default="2") is None
