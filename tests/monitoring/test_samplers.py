"""The NVML sampler against a small stand-in ``pynvml`` module: thread life cycle, errors, and the logged keys.

The stand-in implements the handful of nvidia-ml-py calls the sampler makes, with the real units (memory in
bytes, power in milliwatts) and the real error type, and returns known values; the sampler thread, the
reduction and DeviceStatsLogger are the real code.
"""
from __future__ import annotations

import csv
import sys
import threading
import time
import types
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader

from lit_speed import DeviceStatsLogger
from lit_speed.monitoring.samplers import NvmlSampler, nvml_handle, read_nvml, summarize_gpu_samples

GIB = 1024 ** 3


class NVMLError(Exception):
    """As ``pynvml.NVMLError``: carries an NVML return code."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value


def fake_pynvml(util: int = 87, used: int = 3 * GIB, total: int = 80 * GIB, power_mw: int = 215_000,
                temp: int = 61) -> types.ModuleType:
    """A ``pynvml`` stand-in; set ``module.fail`` to a set of reading names to make them raise NVMLError."""
    m = types.ModuleType("pynvml")
    m.NVMLError = NVMLError
    m.NVML_TEMPERATURE_GPU = 0
    m.fail, m.calls, m.readers = set(), [], set()
    m.uuids = {"GPU-1234": "handle-by-uuid"}

    def call(name: str, value):
        m.calls.append(name)
        if name not in ("init", "shutdown", "by_uuid", "by_index"):
            m.readers.add(threading.current_thread().name)
        if name in m.fail:
            raise NVMLError(999)  # NVML_ERROR_UNKNOWN
        return value

    m.nvmlInit = lambda: call("init", None)
    m.nvmlShutdown = lambda: call("shutdown", None)

    def by_uuid(uuid: str):
        call("by_uuid", None)
        if uuid not in m.uuids:
            raise NVMLError(13)  # NVML_ERROR_NOT_FOUND
        return m.uuids[uuid]

    m.nvmlDeviceGetHandleByUUID = by_uuid
    m.nvmlDeviceGetHandleByIndex = lambda index: call("by_index", f"handle-{index}")
    m.nvmlDeviceGetUtilizationRates = lambda h: call("util", SimpleNamespace(gpu=util, memory=40))
    m.nvmlDeviceGetMemoryInfo = lambda h: call("memory", SimpleNamespace(used=used, total=total, free=total - used))
    m.nvmlDeviceGetPowerUsage = lambda h: call("power", power_mw)
    m.nvmlDeviceGetTemperature = lambda h, sensor: call("temp", temp)
    return m


@pytest.fixture
def pynvml(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


def test_one_reading_has_the_units_the_logger_promises(pynvml) -> None:
    assert read_nvml(pynvml, "h") == {"util_pct": 87.0, "mem_used_bytes": 3.0 * GIB, "mem_total_bytes": 80.0 * GIB,
                                      "power_w": 215.0, "temp_c": 61.0}
    pynvml.fail = {"power"}  # boards without a power sensor raise NVMLError_NotSupported
    assert "power_w" not in read_nvml(pynvml, "h") and read_nvml(pynvml, "h")["temp_c"] == 61.0


def test_handle_by_uuid_falls_back_to_the_index(pynvml) -> None:
    assert nvml_handle(pynvml, 3, "GPU-1234") == "handle-by-uuid"
    assert nvml_handle(pynvml, 3, "GPU-unknown") == "handle-3"
    assert nvml_handle(pynvml, 2, None) == "handle-2"


def test_sampler_thread_samples_off_the_hot_path_survives_errors_and_stops(pynvml) -> None:
    sampler = NvmlSampler(1, every_s=0.01)
    sampler.start()
    assert pynvml.calls[:2] == ["init", "by_index"]  # no CUDA here: no UUID, so the handle comes by index
    time.sleep(0.3)
    assert sampler.running
    first = sampler.drain()
    assert len(first) >= 3  # taken while this thread slept: nothing on the training thread
    assert pynvml.readers == {"lit_speed-nvml"}
    assert summarize_gpu_samples(first) == {"stats/gpu_util_pct": 87.0, "stats/gpu_mem_used_bytes": 3.0 * GIB,
                                            "stats/gpu_mem_total_bytes": 80.0 * GIB, "stats/gpu_power_w": 215.0,
                                            "stats/gpu_temp_c": 61.0}

    pynvml.fail = {"util", "memory", "power", "temp"}  # the driver refuses every reading for a while
    time.sleep(0.15)
    pynvml.fail = set()
    time.sleep(0.15)
    assert sampler.running  # it survived the errors
    after = sampler.drain()
    assert {} in after  # readings during the failure were left out, not made up
    assert after[-1]["util_pct"] == 87.0  # and the readings came back
    assert summarize_gpu_samples(after)["stats/gpu_util_pct"] == 87.0  # empty samples do not dilute the mean

    sampler.stop()
    assert not sampler.running and pynvml.calls[-1] == "shutdown"
    count = len(pynvml.calls)
    time.sleep(0.1)
    assert len(pynvml.calls) == count  # stopped means no more NVML calls


def test_sampler_thread_survives_an_unexpected_error(pynvml) -> None:
    sampler = NvmlSampler(0, every_s=0.01, uuid="GPU-1234")
    pynvml.nvmlDeviceGetTemperature = lambda h, sensor: 1 / 0  # a binding bug, not an NVMLError
    sampler.start()
    assert pynvml.calls[:2] == ["init", "by_uuid"]
    time.sleep(0.2)
    assert sampler.running and sampler.errors >= 3
    sampler.stop()


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 8)

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.net(batch), batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class SlowBatches(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i):
        time.sleep(0.03)  # long enough for the sampler to read several times per logging interval
        return torch.randn(4, 8)


class NvmlOnThisDevice(DeviceStatsLogger):
    """DeviceStatsLogger sampling GPU 0 through NVML although the fit runs on the CPU (no CUDA here)."""

    def make_gpu_sampler(self, device, every_s):
        return NvmlSampler(0, every_s)


def test_nvml_numbers_reach_the_logger_and_the_sampler_stops(pynvml, tmp_path: Path) -> None:
    callback = NvmlOnThisDevice(interval=4, gpu_sample_every_s=0.01, peak_flops=1e11, verbose=False)
    trainer = pl.Trainer(max_steps=12, callbacks=[callback], default_root_dir=tmp_path, accelerator="cpu", devices=1,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         logger=CSVLogger(tmp_path, name="csv", version=""))
    trainer.fit(Tiny(), train_dataloaders=DataLoader(SlowBatches(), batch_size=None))
    rows = [r for r in csv.DictReader((tmp_path / "csv" / "metrics.csv").open()) if r.get("stats/gpu_util_pct")]
    assert [int(r["step"]) for r in rows] == [4, 8, 12]  # every interval of 4 optimizer steps
    for row in rows:
        assert float(row["stats/gpu_util_pct"]) == 87.0
        assert float(row["stats/gpu_mem_used_bytes"]) == 3.0 * GIB
        assert float(row["stats/gpu_power_w"]) == 215.0 and float(row["stats/gpu_temp_c"]) == 61.0
    assert pynvml.calls.count("init") == 1 and pynvml.calls[-1] == "shutdown"  # stopped at the end of the fit
    assert pynvml.readers <= {"lit_speed-nvml", "MainThread"}
