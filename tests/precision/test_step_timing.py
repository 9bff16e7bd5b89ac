"""precision=auto's step timing: interleaved rounds, the on-disk cache, and one decision for every process."""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lit_speed import GuardedPrecision
from lit_speed.precision import modes, step_timing
from lit_speed.tuning import machine_cache

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
    monkeypatch.setattr(machine_cache, "_IN_PROCESS", {})
    return tmp_path


def test_rounds_interleave_the_modes_in_a_rotating_order_within_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    real_init = step_timing.ModeRun.__init__

    def init(self, base, mode, loss_fn) -> None:
        real_init(self, base, mode, loss_fn)
        self.mode = mode

    def step(self, batch) -> None:
        order.append(self.mode)

    monkeypatch.setattr(step_timing.ModeRun, "__init__", init)
    monkeypatch.setattr(step_timing.ModeRun, "step", step)
    samples = step_timing._sample_interleaved(Tiny(), torch.ones(4, 8), MODES, steps=4, budget_s=60.0,
                                              loss_fn=lambda m, b: m(b))
    assert order[:3] == list(MODES)  # one warm-up step each
    rounds = [order[3 + 3 * r: 6 + 3 * r] for r in range(4)]
    assert len(order) == 3 + 12 and all(sorted(r) == sorted(MODES) for r in rounds)
    assert [r[0] for r in rounds] == ["32-true", "bf16-master", "bf16-mixed", "32-true"]  # the first one rotates
    assert {m: len(v) for m, v in samples.items()} == {m: 4 for m in MODES}  # the warm-up is not timed
    order.clear()
    step_timing._sample_interleaved(Tiny(), torch.ones(4, 8), MODES, steps=50, budget_s=0.0, loss_fn=lambda m, b: m(b))
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

    monkeypatch.setattr(machine_cache, "_IN_PROCESS", {})  # a new process: only the file remains

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
        monkeypatch.setattr(machine_cache, "_IN_PROCESS", {})
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
    monkeypatch.setattr(machine_cache, "_IN_PROCESS", {})
    times = step_timing.time_modes(module, batch, MODES)
    assert times == {"32-true": 0.010, "bf16-master": 0.0090, "bf16-mixed": None}  # median of 3 + 5 rounds
    assert step_timing.choose_by_timing(times)[0] == "bf16-master" and len(calls) == 2


def test_disabled_or_damaged_cache_times_afresh(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module, batch = Tiny(), torch.ones(4, 8)
    monkeypatch.setenv("LIT_SPEED_AUTO_CACHE", "0")
    step_timing.time_modes(module, batch, MODES, steps=2)
    assert not (cache_dir / "precision_auto.json").exists()
    monkeypatch.delenv("LIT_SPEED_AUTO_CACHE")
    monkeypatch.setattr(machine_cache, "_IN_PROCESS", {})
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
    """Set-up: rank 1 takes rank 0's rule; first training batch: rank 1 takes rank 0's timed decision, untimed."""
    plugin = GuardedPrecision("auto")
    strategy = _Strategy(("bf16-mixed", "rank 0's rule"))
    trainer = SimpleNamespace(strategy=strategy, world_size=2, global_rank=1, training=True, sanity_checking=False,
                              lightning_module=Tiny())
    monkeypatch.setattr("lit_speed.precision.guarded_precision._trainer_of", lambda module: trainer)
    monkeypatch.setattr("lit_speed.precision.guarded_precision.cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(modes, "check_strategy", lambda mode, strategy: None)
    monkeypatch.setattr(GuardedPrecision, "_resolve", lambda *a, **k: pytest.fail("rank 1 must not probe"))
    monkeypatch.setattr("lit_speed.precision.guarded_precision.auto_mode_for",
                        lambda *a, **k: pytest.fail("rank 1 must not time"))
    plugin._setup(Tiny())
    assert strategy.sent == [None]
    assert plugin.mode == "32-true" and "at the first training batch" in plugin.reason  # until the first batch
    strategy.decision = ("bf16-mixed", "rank 0 timed it")
    plugin.convert_input(torch.ones(4, 8))
    assert (plugin.mode, plugin.reason) == ("bf16-mixed", "rank 0 timed it") and strategy.sent == [None, None]
    plugin.convert_input(torch.ones(4, 8))  # decided once
    assert len(strategy.sent) == 2


# ---- one decision whatever the door: a plain Trainer times the first real batch, and leaves no trace ----------

class _Regressor(pl.LightningModule):
    """Linear regression with dropout (so a shifted RNG would change the weights) on float inputs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.2), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _loader() -> "torch.utils.data.DataLoader":
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)


def _fit(plugin: GuardedPrecision) -> _Regressor:
    module = _Regressor()
    pl.seed_everything(5)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=6, plugins=[plugin], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=_loader())
    return module


@pytest.fixture
def bf16_cpu(monkeypatch: pytest.MonkeyPatch, cache_dir: Path) -> None:
    """Take the timing path on any CPU: native bf16 kernels reported, the matmul probe fast."""
    monkeypatch.setattr("lit_speed.precision.guarded_precision.cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr("lit_speed.precision.guarded_precision.measure_slowdown", lambda dtype: 0.5)


@pytest.mark.parametrize("winner", MODES)
def test_a_plain_trainer_times_its_first_batch_and_trains_exactly_as_the_mode_it_picks(
        bf16_cpu: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, winner: str) -> None:
    """``Trainer(plugins=[GuardedPrecision("auto")])`` with plain dataloaders: the step is timed on the first batch
    (the Hydra path's decision line), and the run is bitwise the run of the chosen mode: the timing drew no batch,
    moved no RNG and, for bf16-master, built the masters before the first step."""
    real = step_timing._sample_interleaved
    timed: list[tuple] = []

    def sample(base, batch, modes_, steps, budget_s, loss_fn):
        timed.append((tuple(modes_), [tuple(t.shape) for t in batch]))
        samples = real(base, batch, modes_, 2, budget_s, loss_fn)  # really runs every mode on the batch
        return {m: (None if v is None else [0.001 if m == winner else 0.002] * len(v)) for m, v in samples.items()}

    monkeypatch.setattr(step_timing, "_sample_interleaved", sample)
    plugin = GuardedPrecision("auto")
    with caplog.at_level("INFO"):
        auto = _fit(plugin)
    assert timed == [(MODES, [(8, 8), (8, 1)])]  # once, on one micro-batch of the real loader
    assert plugin.mode == winner and plugin.reason.startswith("timed this model's step on one micro-batch")
    assert f"precision=auto -> {winner} (timed this model's step" in caplog.text
    fixed = _fit(GuardedPrecision(winner))
    for a, b in zip(auto.state_dict().values(), fixed.state_dict().values()):
        assert torch.equal(a, b)


def test_auto_resumes_with_the_checkpoints_decision_without_timing_again(
        bf16_cpu: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(step_timing, "_sample_interleaved",
                        lambda base, batch, modes_, *a: {m: [0.001 if m == "bf16-master" else 0.002] for m in modes_})
    module, plugin = _Regressor(), GuardedPrecision("auto")
    trainer = pl.Trainer(accelerator="cpu", max_steps=3, plugins=[plugin], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=_loader())
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    assert plugin.mode == "bf16-master"
    monkeypatch.setattr(step_timing, "_sample_interleaved", lambda *a: pytest.fail("a resumed run must not re-time"))
    monkeypatch.setattr(machine_cache, "_IN_PROCESS", {})
    resumed, again = _Regressor(), GuardedPrecision("auto")
    trainer = pl.Trainer(accelerator="cpu", max_steps=5, plugins=[again], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(resumed, train_dataloaders=_loader(), ckpt_path=str(tmp_path / "a.ckpt"))
    assert again.mode == "bf16-master" and "restored from the checkpoint (not timed again)" in again.reason
    assert all(p.dtype == torch.bfloat16 for p in resumed.parameters())  # the masters were rebuilt
    assert trainer.global_step == 5


def test_a_plain_trainer_and_the_hydra_runner_log_the_same_measured_decision(
        bf16_cpu: None, make_cfg, caplog: pytest.LogCaptureFixture) -> None:
    """The issue-24 door check, timed for real (no stand-in timings): ``Trainer(plugins=[GuardedPrecision("auto")])``
    and ``scripts/train.py precision=auto`` both time the model's own step on its first training batch and log one
    decision line of the same form, with the three step times; neither falls back to the matmul probe."""
    from lit_speed.run.runner import train

    line = re.compile(r"^GuardedPrecision: precision=auto -> (32-true|bf16-master|bf16-mixed) \(.*timed this model's "
                      r"step on one micro-batch: 32-true [\d.]+ ms, bf16-master [\d.]+ ms, bf16-mixed [\d.]+ ms\)$")

    def decisions() -> list[str]:
        found = [r.getMessage() for r in caplog.records if "precision=auto ->" in r.getMessage()]
        caplog.clear()
        return found

    with caplog.at_level("INFO"):
        plugin = GuardedPrecision("auto")
        _fit(plugin)  # a plain Lightning project: plain dataloaders, no lit_speed runner
        plain = decisions()
        summary = train(make_cfg(["precision=auto", "trainer.max_steps=3", "trainer.limit_val_batches=1",
                                  "logger=none", "callbacks=none", "validate=false", "trainer.enable_progress_bar=false",
                                  "trainer.enable_model_summary=false"]))
        hydra = decisions()
    assert len(plain) == 1 and line.match(plain[0]), plain
    assert len(hydra) == 1 and line.match(hydra[0]), hydra
    assert plugin.mode == line.match(plain[0]).group(1)  # the line says what the run then trained in
    assert summary["components"]["GuardedPrecision"]["mode"] == line.match(hydra[0]).group(1)
