"""The time-to-target race's shared instrument and the benchmark's core logic, run cheaply (no timing asserted)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import lightning.pytorch as pl
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` by file path: benchmarks/ is a folder of scripts, not an importable package."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # the scripts import each other by these names (``import _common``)
    spec.loader.exec_module(module)
    return module


_load_benchmark("_common")
bench = _load_benchmark("bench_time_to_target")
plain_loop = _load_benchmark("plain_loop")

from lit_speed.data.charlm import CharLMDataModule  # noqa: E402
from lit_speed.models.gpt import GPTModule  # noqa: E402
from lit_speed.reporting.fixed_validation import FixedValidationClock, TokenCadenceProbe, mean_token_loss  # noqa: E402

CACHE = str(ROOT / ".cache" / "charlm")


def test_probe_validates_on_a_token_cadence_and_records_the_first_crossing() -> None:
    values = iter([3.0, 2.0, 1.7, 1.6])
    probe = TokenCadenceProbe(dataset=list(range(5)), every_tokens=100, target=1.8, clock_start=0.0)
    met = [probe.after_batch(40, step, lambda: next(values)) for step in range(1, 11)]  # 400 tokens
    assert [h["tokens"] for h in probe.history] == [120, 200, 320, 400]  # first batch at or past each 100
    assert met.index(True) == 7 and probe.target_step == 8 and probe.target_tokens == 320
    summary = probe.summary()
    assert summary["reached"] and summary["best_val_loss"] == 1.6 and summary["windows"] == 5
    with pytest.raises(ValueError, match="every_tokens must be a positive int"):
        TokenCadenceProbe([], every_tokens=0)


def test_mean_token_loss_does_not_depend_on_the_validation_batch_size() -> None:
    dm = CharLMDataModule(cache_dir=CACHE, block_size=64, batch_size=12)
    dm.setup()
    torch.manual_seed(0)
    model = GPTModule(n_layer=1, n_head=2, n_embd=32).eval()
    subset = torch.utils.data.Subset(dm.val_dataset, list(range(40)))
    assert mean_token_loss(model, subset, 64) == pytest.approx(mean_token_loss(model, subset, 7), rel=1e-6)
    assert len(dm.val_dataset) == 512  # the fixed windows every variant validates on


def test_plain_loop_and_lightning_are_checked_at_the_same_tokens_on_the_same_windows(tmp_path: Path) -> None:
    probe = TokenCadenceProbe(None, every_tokens=1536, target=None)
    plain_loop.train(plain_loop.LoopConfig(max_steps=4, val_every=0, cache_dir=CACHE, constant_lr=True, lr=1e-3),
                     probe=probe)
    clock = FixedValidationClock(target=0.5, every_tokens=1536, out_path=str(tmp_path / "clock.json"))
    dm = CharLMDataModule(cache_dir=CACHE, block_size=64, batch_size=12)
    trainer = pl.Trainer(accelerator="cpu", max_steps=4, limit_val_batches=0, logger=False, callbacks=[clock],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(GPTModule(n_layer=1, n_head=2, n_embd=32,
                          optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3)), datamodule=dm)
    lightning_summary = clock.probe.summary()
    assert [h["tokens"] for h in probe.history] == [h["tokens"] for h in lightning_summary["history"]] == [1536, 3072]
    assert probe.summary()["windows"] == lightning_summary["windows"] == 512
    assert (tmp_path / "clock.json").exists() and not lightning_summary["reached"]
    assert all(h["wall_s"] > 0 for h in lightning_summary["history"])  # clock from process launch


def test_summary_takes_medians_over_reached_runs_and_ratios_compare_medians() -> None:
    def run(t: float | None, step: int | None) -> dict:
        # one validation above every target, then the first at or below 1.80 (at t seconds), then 1.70 later
        history = [{"tokens": 768, "step": 1, "wall_s": 1.0, "val_loss": 2.5}]
        if t is not None:
            history += [{"tokens": step * 768, "step": step, "wall_s": t, "val_loss": 1.79},
                        {"tokens": 2 * step * 768, "step": 2 * step, "wall_s": 2 * t, "val_loss": 1.70}]
        return {"history": history, "best_val_loss": min(h["val_loss"] for h in history)}

    runs = {"lit_speed": [run(30, 900), run(34, 1000), run(None, None)],
            "plain_lightning": [run(70, 1600), run(80, 1700), run(75, 1600)]}
    summary = bench.summarize(runs, 1.80)
    assert summary["lit_speed"]["reached"] == "2/3" and summary["lit_speed"]["time_to_target_s"]["median"] == 32
    assert summary["plain_lightning"]["steps_to_target"]["median"] == 1600
    assert bench.ratio(summary, "lit_speed", "plain_lightning") == round(32 / 75, 3)
    assert bench.ratio(summary, "lit_speed", "missing") is None
    lower = bench.summarize(runs, 1.70)  # a lower target, read from the same histories
    assert lower["lit_speed"]["time_to_target_s"]["median"] == 64 and lower["plain_lightning"]["reached"] == "3/3"
    assert bench.summarize(runs, 1.60)["lit_speed"]["time_to_target_s"] is None


def test_lit_speed_variant_is_the_preset_command_with_the_shared_instrument() -> None:
    cmd = bench.lit_speed_command(7, None, 1.8, 76800, "/tmp/x.json", "/tmp/run")
    assert "experiment=charlm_fast" in cmd and "seed=7" in cmd and "trainer.limit_val_batches=0" in cmd
    assert "+callbacks.clock.every_tokens=76800" in cmd and not any(c.startswith("trainer.max_steps") for c in cmd)
    recipe = bench.preset_recipe()
    assert recipe["batch_size"] >= 1 and recipe["lr"] > 0 and recipe["max_steps"] >= 1


def test_png_of_val_loss_against_wall_seconds_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    history = [{"tokens": 76800 * i, "step": 100 * i, "wall_s": 10.0 * i, "val_loss": 2.5 - 0.2 * i} for i in range(1, 5)]
    bench.plot({"lit_speed": [{"history": history}], "plain_lightning": [{"history": history[:2]}]}, 1.8,
               tmp_path / "race.png")
    assert (tmp_path / "race.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_race_keeps_the_measured_choices_a_lit_speed_run_printed() -> None:
    """Each lit_speed run's choices (timed at its start, different from run to run on near ties) go into the result:
    the lines of the log that name a measured setting, nothing else."""
    output = "\n".join([
        "non-finite guard   fallback after 3 bad steps -> 32-true",  # the start-up table: not a measured choice
        "GuardedPrecision: threads=auto -> 2 (timed here: 1 79.78 ms, 2 56.38 ms)",
        "GuardedPrecision: precision=auto -> 32-true (timed this model's step on one micro-batch: 32-true 57.5 ms)",
        "Epoch 0: loss 2.1",
        "Muon: optimizer.ns_dtype -> bfloat16 (timed here: bfloat16 10.05 ms, float32 11.65 ms)",
        "MuonAdamW: optimizer.adamw_kernel -> fused (timed here: fused 0.16 ms, foreach 0.40 ms)"])
    assert [line.split(" -> ")[0] for line in bench.measured_choices(output)] == [
        "GuardedPrecision: threads=auto", "GuardedPrecision: precision=auto", "Muon: optimizer.ns_dtype",
        "MuonAdamW: optimizer.adamw_kernel"]
