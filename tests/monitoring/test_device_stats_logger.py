"""DeviceStatsLogger through a real Trainer on CPU: verdicts on built-to-be-slow workloads, logged keys, resume."""
from __future__ import annotations

import csv
import json
import time
import warnings
from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils._python_dispatch import is_in_torch_dispatch_mode
from torch.utils.data import DataLoader, Dataset

from lit_speed import DeviceStatsLogger
from lit_speed.monitoring import METRICS
from lit_speed.monitoring.samplers import NvmlSampler

SGD = partial(torch.optim.SGD, lr=0.01)


class Regression(pl.LightningModule):
    """``layers`` square Linear layers of ``width``; optimizer chosen by the test."""

    def __init__(self, width: int, layers: int, optimizer=SGD,
                 val_sleep_s: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        self.optimizer = optimizer
        self.val_sleep_s = val_sleep_s
        self.val_calls = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        time.sleep(self.val_sleep_s)  # a slow validation must not look like data wait
        self.val_calls += 1

    def configure_optimizers(self):
        return self.optimizer(self.parameters())


class Batches(Dataset):
    """Whole batches prepared in memory (the "preloaded" case); ``sleep_s`` per batch makes a slow loader."""

    def __init__(self, n: int, batch: int, width: int, sleep_s: float = 0.0) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = [(torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)) for _ in range(n)]
        self.sleep_s = sleep_s

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        time.sleep(self.sleep_s)
        return self.data[i]


def fit(tmp_path: Path, model: pl.LightningModule, data: Dataset, steps: int, callback: DeviceStatsLogger,
        logger: bool = False, val: Dataset | None = None, **trainer_kwargs) -> pl.Trainer:
    trainer = pl.Trainer(max_steps=steps, callbacks=[callback], default_root_dir=tmp_path, accelerator="cpu",
                         devices=1, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, num_sanity_val_steps=0,
                         logger=CSVLogger(tmp_path, name="csv", version="") if logger else False, **trainer_kwargs)
    val_loader = DataLoader(val, batch_size=None) if val is not None else None
    trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=None, shuffle=False), val_dataloaders=val_loader)
    return trainer


def test_slow_dataloader_is_input_bound(tmp_path):
    width = 16
    cb = DeviceStatsLogger(interval=2, peak_flops=1e11)
    fit(tmp_path, Regression(width, 1), Batches(8, 8, width, sleep_s=0.15), steps=6, callback=cb)
    result = json.loads((tmp_path / "bottleneck.json").read_text())
    assert result == json.loads(json.dumps(cb.final_summary()))
    assert result["verdict"] == "input-bound", result["summary"]
    assert result["evidence"]["batches"] == 5  # 6 steps, the first is warm-up (FLOP counting)
    assert result["per_rank_memory_peak_bytes"] == [result["evidence"]["memory_peak_bytes"]]
    # 5 waits of >= 0.15 s were slept: the measured wait cannot be shorter
    assert result["evidence"]["data_wait_s"] >= 5 * 0.15


def test_compute_heavy_model_on_preloaded_data_is_compute_bound(tmp_path):
    # batch 1024: the matmuls are ~4x the optimizer's share at batch 256, where a busy 2-core machine once pushed
    # one Adam step over the optimizer-bound line (26% of step time); the verdict under test is the compute one
    width, batch = 256, 1024
    cb = DeviceStatsLogger(interval=2)
    fit(tmp_path, Regression(width, 4), Batches(8, batch, width), steps=7, callback=cb)
    result = cb.final_summary()
    assert result["verdict"] == "compute-bound", result["summary"]
    # four Linear layers, each: forward, grad of weight, and (except the first) grad of input
    per_layer = 2 * batch * width * width
    assert result["flops_per_batch"] == (4 + 4 + 3) * per_layer
    assert 0 < result["evidence"]["mfu"] == pytest.approx(result["evidence"]["flops_per_sec"] / result["peak_flops"])
    assert not is_in_torch_dispatch_mode()  # the FLOP counter left after the first batch


def test_accumulation_counts_one_micro_batch_and_logs_per_optimizer_step(tmp_path):
    width, batch = 32, 4
    cb = DeviceStatsLogger(interval=2, peak_flops=1e11)
    fit(tmp_path, Regression(width, 2), Batches(10, batch, width), steps=4, callback=cb, logger=True,
        accumulate_grad_batches=2)
    assert not is_in_torch_dispatch_mode()
    per_layer = 2 * batch * width * width
    assert cb.flops_per_batch == (2 + 2 + 1) * per_layer  # the micro-batch's forward+backward, counted once
    rows = [r for r in read_csv(tmp_path / "csv" / "metrics.csv") if r.get("time/batch_ms")]
    assert [int(r["step"]) for r in rows] == [2, 4]  # 8 micro-batches, 4 optimizer steps
    assert cb.final_summary()["evidence"]["batches"] == 7  # the first micro-batch is warm-up


def test_huge_optimizer_is_optimizer_bound(tmp_path):
    width = 1024  # 4 x 1M parameters, a batch of one sample: the for-loop AdamW dwarfs the matmuls
    adam = partial(torch.optim.AdamW, lr=1e-4, foreach=False)
    cb = DeviceStatsLogger(interval=2, peak_flops=1e11)
    fit(tmp_path, Regression(width, 4, optimizer=adam), Batches(6, 1, width), steps=5, callback=cb)
    result = cb.final_summary()
    assert result["verdict"] == "optimizer-bound", result["summary"]
    assert "adamw_fused" in result["next_step"]


def test_a_flop_formula_that_fails_costs_the_mfu_not_the_run(tmp_path, monkeypatch):
    from torch.utils.flop_counter import flop_registry

    def broken(*args, **kwargs):
        raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")

    monkeypatch.setitem(flop_registry, torch.ops.aten.addmm, broken)
    cb = DeviceStatsLogger(interval=2, peak_flops=1e11)
    with pytest.warns(UserWarning, match=r"FLOP counting failed \(aten.addmm: AssertionError: sdpa_flop_count.*"
                                         r"Fix: set `flops_per_batch`.*callbacks.device_stats.measure_flops=false"):
        trainer = fit(tmp_path, Regression(16, 2), Batches(4, 8, 16), steps=4, callback=cb)
    assert trainer.global_step == 4 and cb.flops_per_batch is None
    assert cb.final_summary().get("evidence", {}).get("mfu") is None


def test_slow_validation_is_not_counted_as_data_wait(tmp_path):
    width = 16
    cb = DeviceStatsLogger(interval=2, peak_flops=1e11)
    model = Regression(width, 1, val_sleep_s=0.3)
    fit(tmp_path, model, Batches(8, 8, width), steps=6, callback=cb,
        val=Batches(1, 8, width), val_check_interval=2, check_val_every_n_epoch=None)
    assert model.val_calls == 3  # validations after steps 2, 4 and 6
    result = cb.final_summary()
    # three validations slept 0.9 s in total; counted as data wait they would be >= 0.9 s of it
    assert result["evidence"]["data_wait_s"] < 0.3, result["evidence"]


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_logged_keys_units_and_interval_against_csv_logger(tmp_path):
    width, batch, interval, steps = 32, 16, 2, 6
    cb = DeviceStatsLogger(interval=interval)
    fit(tmp_path, Regression(width, 2), Batches(10, batch, width), steps=steps, callback=cb, logger=True)
    rows = [r for r in read_csv(tmp_path / "csv" / "metrics.csv") if r.get("time/batch_ms")]
    assert [int(r["step"]) for r in rows] == list(range(interval, steps + 1, interval))
    cpu_keys = {k for k in METRICS if not k.startswith("stats/gpu") and k != "throughput/tokens_per_sec"}
    logged = {k for k in rows[0] if rows[0][k] not in ("", None) and k not in ("step", "epoch")}
    assert logged == cpu_keys  # float batches: no tokens; CPU: no GPU keys
    for row in rows:
        v = {k: float(row[k]) for k in cpu_keys}
        assert v["time/data_wait_frac"] + v["time/forward_backward_frac"] + v["time/optimizer_frac"] == pytest.approx(1)
        assert v["throughput/samples_per_sec"] * v["time/batch_ms"] / 1000 == pytest.approx(batch)
        assert v["perf/mfu"] == pytest.approx(v["perf/tflops_per_sec"] * 1e12 / cb.result["peak_flops"])
        assert 0 < v["stats/cpu_rss_bytes"] <= v["stats/cpu_rss_peak_bytes"]
        assert v["stats/sys_mem_available_bytes"] > 0


def test_token_batches_log_tokens_per_sec(tmp_path):
    class TinyLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(50, 8)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.emb(x).view(-1, 8), y.view(-1) % 8)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = [(torch.randint(0, 50, (4, 10)), torch.randint(0, 50, (4, 10))) for _ in range(6)]
    fit(tmp_path, TinyLM(), data, steps=4, callback=DeviceStatsLogger(interval=2, peak_flops=1e11), logger=True)
    rows = [r for r in read_csv(tmp_path / "csv" / "metrics.csv") if r.get("throughput/tokens_per_sec")]
    assert len(rows) == 2
    for row in rows:
        # tokens per batch = 4 x 10, samples per batch = 4
        assert float(row["throughput/tokens_per_sec"]) == pytest.approx(10 * float(row["throughput/samples_per_sec"]))


def test_resume_carries_the_run_totals(tmp_path):
    width = 16
    data = Batches(12, 8, width)
    first = DeviceStatsLogger(interval=2, peak_flops=1e11)
    trainer = fit(tmp_path, Regression(width, 1), data, steps=4, callback=first)
    ckpt = tmp_path / "half.ckpt"
    trainer.save_checkpoint(ckpt)
    assert first.final_summary()["evidence"]["batches"] == 3
    second = DeviceStatsLogger(interval=2, peak_flops=1e11)
    trainer = pl.Trainer(max_steps=8, callbacks=[second], default_root_dir=tmp_path, accelerator="cpu",
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         logger=False)
    trainer.fit(Regression(width, 1), train_dataloaders=DataLoader(data, batch_size=None), ckpt_path=ckpt)
    # each process leaves its first batch out as warm-up: 3 timed before the checkpoint + 3 after
    assert second.final_summary()["evidence"]["batches"] == 6
    assert second.final_summary()["flops_per_batch"] == first.final_summary()["flops_per_batch"]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"interval": 0}, r"interval must be an int >= 1 optimizer steps .* got 0"),
    ({"peak_flops": -1.0}, r"peak_flops must be > 0 FLOP/s .* got -1.0"),
    ({"gpu_sample_every_s": 0}, r"gpu_sample_every_s must be > 0 seconds, or None to skip NVML, got 0"),
])
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DeviceStatsLogger(**kwargs)


def test_missing_nvml_names_the_package():
    try:
        import pynvml  # noqa: F401
    except ModuleNotFoundError:
        with pytest.raises(ModuleNotFoundError, match=r"GPU utilisation needs nvidia-ml-py: pip install"):
            NvmlSampler(0)
    else:
        pytest.skip("nvidia-ml-py is installed here, so the missing-package message cannot be exercised")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device and nvidia-ml-py for NVML readings")
def test_gpu_keys_from_nvml_and_cuda_events(tmp_path):
    pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed: pip install 'lit_speed[gpu]'")
    width = 512
    cb = DeviceStatsLogger(interval=2, gpu_sample_every_s=0.05)
    trainer = pl.Trainer(max_steps=6, callbacks=[cb], default_root_dir=tmp_path, accelerator="cuda", devices=1,
                         enable_progress_bar=False, enable_checkpointing=False,
                         logger=CSVLogger(tmp_path, name="csv", version=""))
    trainer.fit(Regression(width, 4), train_dataloaders=DataLoader(Batches(8, 512, width), batch_size=None))
    rows = [r for r in read_csv(tmp_path / "csv" / "metrics.csv") if r.get("time/batch_ms")]
    gpu_keys = {k for k in METRICS if k.startswith("stats/gpu")} - {"stats/gpu_power_w"}  # some boards lack power
    assert all(all(row.get(k) not in ("", None) for k in gpu_keys) for row in rows)
    assert 0 <= float(rows[-1]["stats/gpu_util_pct"]) <= 100
    assert cb.final_summary()["peak_flops_source"].startswith(("datasheet", "NVIDIA"))


def test_yaml_keys_are_the_constructor_arguments():
    import inspect

    from omegaconf import OmegaConf

    node = OmegaConf.load(Path(__file__).resolve().parents[2] / "conf" / "callbacks" / "device_stats.yaml")
    keys = set(node.device_stats) - {"_target_"}
    assert keys == set(inspect.signature(DeviceStatsLogger.__init__).parameters) - {"self"}
    assert node.device_stats._target_ == "lit_speed.monitoring.device_stats_logger.DeviceStatsLogger"


def test_default_config_runs_it_and_writes_the_verdict(make_cfg, tmp_path):
    from lit_speed.run.runner import train

    cfg = make_cfg(["trainer.max_epochs=1", "trainer.limit_train_batches=6", "trainer.limit_val_batches=1",
                    "trainer.log_every_n_steps=2", "trainer.enable_progress_bar=false", "validate=false"])
    summary = train(cfg)
    verdict = json.loads((tmp_path / "bottleneck.json").read_text())
    assert summary["components"]["DeviceStatsLogger"]["verdict"] == verdict["verdict"]
    assert verdict["evidence"]["batches"] == 5
    assert summary["startup"]["device stats"].startswith("every log_every_n_steps")
    rows = [r for r in read_csv(tmp_path / "csv" / "metrics.csv") if r.get("time/batch_ms")]
    assert [int(r["step"]) for r in rows] == [2, 4, 6]  # interval=null follows trainer.log_every_n_steps


@pytest.mark.slow
def test_ddp_two_processes_log_on_rank_zero_with_per_rank_memory(tmp_path):
    from tests.helpers.repo import run_train_script

    proc = run_train_script(["trainer=ddp_cpu", "strategy=ddp", "trainer.max_epochs=1", "trainer.limit_train_batches=6",
                             "trainer.limit_val_batches=1", "trainer.log_every_n_steps=2", "validate=false",
                             "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path}"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    verdict = json.loads((tmp_path / "bottleneck.json").read_text())
    assert verdict["world_size"] == 2
    per_rank = verdict["per_rank_memory_peak_bytes"]
    assert len(per_rank) == 2 and min(per_rank) > 0
    assert verdict["evidence"]["memory_peak_bytes"] == max(per_rank)  # the verdict judges the fullest rank
    assert proc.stdout.count("lit_speed bottleneck") == 1  # the table is printed by rank zero only
    rows = [r for r in read_csv(tmp_path / "csv" / "metrics.csv") if r.get("time/batch_ms")]
    assert [int(r["step"]) for r in rows] == [2, 4, 6]  # one row per interval, not one per rank


def test_mfu_divides_by_the_peak_of_the_mode_precision_auto_chose_on_the_first_batch(tmp_path, monkeypatch):
    # precision=auto runs 32-true until its first-batch timing picks a mode; the peak must be the chosen mode's
    from lit_speed import GuardedPrecision

    monkeypatch.setattr("lit_speed.precision.guarded_precision.cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr("lit_speed.precision.guarded_precision.measure_slowdown", lambda dtype: 1.0)  # any CPU
    monkeypatch.setattr("lit_speed.monitoring.flops.cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr("lit_speed.precision.guarded_precision.auto_mode_for",
                        lambda *a, **k: ("bf16-mixed", "stand-in timing"))
    probed = []
    monkeypatch.setattr("lit_speed.monitoring.flops.measure_cpu_peak_flops",
                        lambda dtype: probed.append(dtype) or 1e11)
    stats = DeviceStatsLogger(interval=2)
    fit(tmp_path, Regression(16, 2), Batches(4, 8, 16), 4, stats, plugins=[GuardedPrecision("auto")])
    assert probed == [torch.bfloat16] and "bfloat16" in stats.final_summary()["peak_flops_source"]


def test_on_a_cpu_without_bf16_units_mfu_divides_by_the_higher_float32_peak(tmp_path, monkeypatch):
    # bf16 kernels there convert to float32: a tiny model's step outruns a large bf16 matmul (MFU > 1 on a Zen3)
    from lit_speed import GuardedPrecision

    monkeypatch.setattr("lit_speed.monitoring.flops.cpu_has_native_bf16", lambda: False)
    peaks = {torch.bfloat16: 1e9, torch.float32: 5e10}
    monkeypatch.setattr("lit_speed.monitoring.flops.measure_cpu_peak_flops", lambda dtype: peaks[dtype])
    stats = DeviceStatsLogger(interval=2)
    with warnings.catch_warnings():  # bf16-mixed on a CPU that is slow at it is warned about (this one may not be)
        warnings.simplefilter("ignore")
        fit(tmp_path, Regression(16, 2), Batches(4, 8, 16), 4, stats, plugins=[GuardedPrecision("bf16-mixed")])
    summary = stats.final_summary()
    assert summary["peak_flops"] == 5e10 and "has no torch.bfloat16 matmul units" in summary["peak_flops_source"]


def test_the_cpu_peak_probe_draws_nothing_from_the_global_rng():
    # it runs at the first training batch: a draw there would move a resumed run away from the uninterrupted one
    from lit_speed.monitoring.flops import measure_cpu_peak_flops

    state = torch.get_rng_state()
    measure_cpu_peak_flops(torch.float32, size=96, seconds=0.01)
    assert torch.equal(state, torch.get_rng_state())
