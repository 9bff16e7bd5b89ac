"""precision=auto's step timing: interleaved rounds, the on-disk cache, and one decision for every process."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lit_speed import GuardedPrecision
from lit_speed.precision import modes, step_timing

MODES = ("32-true", "bf16-master", "bf16-mixed")


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.layer(batch.to(self.layer.weight.dtype)).float().pow(2).mean()


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LIT_SPEED_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LIT_SPEED_AUTO_CACHE", raising=False)
    monkeypatch.setattr(step_timing, "_CACHE", {})
    return tmp_path


def test_rounds_interleave_the_modes_in_a_rotating_order_within_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    real_init = step_timing._ModeRun.__init__

    def init(self, base, mode, loss_fn) -> None:
        real_init(self, base, mode, loss_fn)
        self.mode = mode

    def step(self, batch) -> float:
        order.append(self.mode)
        return 0.001 * (1 + MODES.index(self.mode))

    monkeypatch.setattr(step_timing._ModeRun, "__init__", init)
    monkeypatch.setattr(step_timing._ModeRun, "step", step)
    times = step_timing._time_interleaved(Tiny(), torch.ones(4, 8), MODES, steps=4, budget_s=60.0,
                                          loss_fn=lambda m, b: m(b))
    assert order[:3] == list(MODES)  # one warm-up step each
    rounds = [order[3 + 3 * r: 6 + 3 * r] for r in range(4)]
    assert len(order) == 3 + 12 and all(sorted(r) == sorted(MODES) for r in rounds)
    assert [r[0] for r in rounds] == ["32-true", "bf16-master", "bf16-mixed", "32-true"]  # the first one rotates
    assert times == {"32-true": 0.001, "bf16-master": 0.002, "bf16-mixed": 0.003}
    order.clear()
    step_timing._time_interleaved(Tiny(), torch.ones(4, 8), MODES, steps=50, budget_s=0.0, loss_fn=lambda m, b: m(b))
    assert len(order) == 3 + 2 * 3  # a spent budget still times two rounds


def test_timings_are_cached_on_disk_and_reused_without_timing(cache_dir: Path, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    monkeypatch.setattr(step_timing, "SETTLE_ROUNDS", 2)  # settled whatever this tiny model's timings say
    module, batch = Tiny(), torch.ones(4, 8)
    times = step_timing.time_modes(module, batch, MODES, steps=2)
    entry = json.loads((cache_dir / "precision_auto.json").read_text())
    assert [e["times"] for e in entry.values()] == [times]
    key = json.loads(next(iter(entry)))
    assert key["hardware"] and key["torch"] == torch.__version__ and key["params"] == 72 and key["modes"] == list(MODES)

    monkeypatch.setattr(step_timing, "_CACHE", {})  # a new process: only the file remains

    def no_timing(*args, **kwargs):
        raise AssertionError("timed again although the disk cache holds this model, batch and machine")

    monkeypatch.setattr(step_timing, "_sample_interleaved", no_timing)
    assert step_timing.time_modes(module, batch, MODES) == times
    assert step_timing.cached_when(module, batch, MODES) is not None
    assert step_timing._timings(module, batch, MODES) == (times, step_timing.cached_when(module, batch, MODES))
    with pytest.raises(AssertionError, match="timed again"):  # another batch shape is another entry
        step_timing.time_modes(module, torch.ones(2, 8), MODES)


def _timer_returning(rounds: list[dict[str, list[float]]], calls: list[int]):
    """A stand-in for the interleaved timer: each call returns the next run's samples and counts itself."""
    def sample(base, batch, modes, steps, budget_s, loss_fn):
        calls.append(1)
        return {m: (None if rounds[len(calls) - 1][m] is None else list(rounds[len(calls) - 1][m])) for m in modes}
    return sample


@pytest.mark.parametrize("bf16_ms, timings_expected", [(9.9, 2), (5.0, 1)], ids=["inside-the-margin", "clear"])
def test_an_undecided_choice_is_timed_again_by_the_next_runs_until_settled(
        cache_dir: Path, monkeypatch: pytest.MonkeyPatch, bf16_ms: float, timings_expected: int) -> None:
    """bf16-master 1% faster keeps 32-true but is re-timed (rounds pooled) until SETTLE_ROUNDS; 50% faster settles."""
    monkeypatch.setattr(step_timing, "SETTLE_ROUNDS", 6)
    run = {"32-true": [0.010] * 3, "bf16-master": [bf16_ms / 1000] * 3, "bf16-mixed": [0.011] * 3}
    calls: list[int] = []
    monkeypatch.setattr(step_timing, "_sample_interleaved", _timer_returning([run] * 5, calls))
    module, batch = Tiny(), torch.ones(4, 8)
    for _ in range(4):  # four runs, each a new process
        monkeypatch.setattr(step_timing, "_CACHE", {})
        times, when = step_timing._timings(module, batch, MODES)
    assert len(calls) == timings_expected  # inside the margin: 3 + 3 rounds pooled = settled; clear: once
    entry = next(iter(json.loads((cache_dir / "precision_auto.json").read_text()).values()))
    assert len(entry["samples"]["32-true"]) == 3 * timings_expected
    assert when is not None and step_timing.settled(entry)
    assert step_timing.choose_by_timing(times)[0] == ("32-true" if bf16_ms > 9.8 else "bf16-master")


def test_pooled_rounds_decide_by_their_median_and_a_mode_non_finite_once_stays_out(
        cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A first run inside the margin, a second that shows bf16-master 10% faster: the pooled median switches."""
    first = {"32-true": [0.010] * 3, "bf16-master": [0.0099] * 3, "bf16-mixed": [0.0099] * 3}
    second = {"32-true": [0.010] * 5, "bf16-master": [0.0090] * 5, "bf16-mixed": None}
    calls: list[int] = []
    monkeypatch.setattr(step_timing, "_sample_interleaved", _timer_returning([first, second], calls))
    module, batch = Tiny(), torch.ones(4, 8)
    assert step_timing.choose_by_timing(step_timing.time_modes(module, batch, MODES))[0] == "32-true"
    monkeypatch.setattr(step_timing, "_CACHE", {})
    times = step_timing.time_modes(module, batch, MODES)
    assert times == {"32-true": 0.010, "bf16-master": 0.0090, "bf16-mixed": None}  # median of 3 + 5 rounds
    assert step_timing.choose_by_timing(times)[0] == "bf16-master" and len(calls) == 2


def test_disabled_or_damaged_cache_times_afresh(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module, batch = Tiny(), torch.ones(4, 8)
    monkeypatch.setenv("LIT_SPEED_AUTO_CACHE", "0")
    step_timing.time_modes(module, batch, MODES, steps=2)
    assert not (cache_dir / "precision_auto.json").exists()
    monkeypatch.delenv("LIT_SPEED_AUTO_CACHE")
    monkeypatch.setattr(step_timing, "_CACHE", {})
    (cache_dir / "precision_auto.json").write_text("{not json")
    times = step_timing.time_modes(module, batch, MODES, steps=2)
    assert list(json.loads((cache_dir / "precision_auto.json").read_text()).values())[0]["times"] == times


def test_candidates_exclude_the_modes_the_strategy_refuses() -> None:
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    assert modes.allowed_modes(MODES, None) == list(MODES)
    assert modes.allowed_modes(MODES, SingleDeviceStrategy(torch.device("cpu"))) == list(MODES)
    assert modes.allowed_modes(MODES, DDPStrategy()) == ["32-true", "bf16-mixed"]


class _Strategy:
    """Stands in for a 2-process strategy: ``broadcast`` hands every rank rank 0's decision."""

    root_device = torch.device("cpu")

    def __init__(self, decision: tuple[str, str]) -> None:
        self.decision, self.sent = decision, []

    def broadcast(self, obj, src: int = 0):
        self.sent.append(obj)
        return self.decision


def test_other_ranks_take_rank_zeros_decision_without_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    plugin = GuardedPrecision("auto")
    strategy = _Strategy(("bf16-mixed", "rank 0 timed it"))
    trainer = SimpleNamespace(strategy=strategy, world_size=2, global_rank=1)
    monkeypatch.setattr("lit_speed.precision.guarded_precision._trainer_of", lambda module: trainer)
    monkeypatch.setattr(modes, "check_strategy", lambda mode, strategy: None)
    monkeypatch.setattr(GuardedPrecision, "_resolve", lambda *a, **k: pytest.fail("rank 1 must not time"))
    plugin._setup(Tiny())
    assert (plugin.mode, plugin.reason) == ("bf16-mixed", "rank 0 timed it") and strategy.sent == [None]
