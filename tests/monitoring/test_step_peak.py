"""One source for MFU's peak (issue 50, item 1): the step's FLOPs by the dtype their matmuls ran in, each at that
dtype's peak; MFU never above 100%; the verdict does not advise bf16 to a run whose FLOPs already use it.

Before: the peak was the precision mode's dtype alone, so a 1B LoRA run whose frozen base computed in bf16 under
precision=32-true divided by the float32 probe (``MFU 197.0% (peak: torch.float32 matmul probe)``) and was told to
try "cheaper arithmetic (bf16-mixed)".
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lit_speed.monitoring.diagnosis import RunStats, diagnose
from lit_speed.monitoring.flops import (
    FlopCount,
    cpu_peak_flops,
    low_precision_share,
    model_flops_utilization,
    step_peak_flops,
)


def test_flops_are_counted_by_the_dtype_their_matmuls_ran_in():
    torch.manual_seed(0)
    bf16, fp32 = nn.Linear(32, 64, bias=False), nn.Linear(64, 8, bias=False)
    x = torch.randn(4, 32)
    counter = FlopCount()
    counter.start()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = bf16(x)
    fp32(hidden.float()).sum().backward()
    total = counter.stop()
    # forward 2*B*in*out; backward: the input gradient of both layers' (the first layer's x needs none) + weight grads
    first, second = 2 * 4 * 32 * 64, 2 * 4 * 64 * 8
    assert counter.by_dtype == {torch.bfloat16: 2 * first, torch.float32: 3 * second}
    assert total == sum(counter.by_dtype.values())


def test_the_step_peak_weighs_each_dtype_by_the_time_its_flops_take_at_its_peak():
    peaks = {torch.bfloat16: (4e11, "bf16 probe"), torch.float32: (2e11, "fp32 probe")}
    peak, source = step_peak_flops({torch.bfloat16: 9e9, torch.float32: 1e9}, peaks.get)
    assert peak == pytest.approx(10e9 / (9e9 / 4e11 + 1e9 / 2e11))
    assert source == "the step's FLOP mix: 90% torch.bfloat16 (bf16 probe), 10% torch.float32 (fp32 probe)"
    assert step_peak_flops({torch.bfloat16: 5.0}, peaks.get) == (4e11, "bf16 probe")  # one dtype: its own peak
    assert step_peak_flops({}, peaks.get) == (None, "no FLOPs counted")


def test_mfu_is_never_above_one_and_unknown_without_a_peak():
    assert model_flops_utilization(2e11, 1e11) == 1.0
    assert model_flops_utilization(5e10, 1e11) == 0.5
    assert model_flops_utilization(5e10, None) is None


def test_a_cpu_without_bf16_units_uses_its_float32_peak_for_bf16(monkeypatch):
    monkeypatch.setattr("lit_speed.monitoring.flops.cpu_has_native_bf16", lambda: False)
    probed = []
    monkeypatch.setattr("lit_speed.monitoring.flops.measure_cpu_peak_flops", lambda d: probed.append(d) or 1e11)
    peak, source = cpu_peak_flops(torch.bfloat16)
    assert (peak, probed) == (1e11, [torch.float32]) and "no torch.bfloat16 matmul units" in source


@pytest.mark.parametrize(("share", "advised"), [(0.9, False), (0.0, True), (None, True)])
def test_the_verdict_advises_bf16_only_to_a_run_whose_flops_do_not_use_it(share, advised):
    stats = RunStats(data_wait_s=0.05, forward_backward_s=0.9, optimizer_s=0.05, batches=10, mfu=0.8,
                     low_precision_frac=share)
    next_step = diagnose(stats)["next_step"]
    assert ("bf16-mixed" in next_step) is advised
    if not advised:
        assert "90% of the FLOPs already run in bf16/fp16" in next_step


def test_low_precision_share():
    assert low_precision_share({torch.bfloat16: 3.0, torch.float32: 1.0}) == 0.75
    assert low_precision_share({}) is None


def test_a_run_whose_frozen_base_computes_in_bf16_divides_by_the_bf16_peak(make_cfg, tmp_path):
    pytest.importorskip("transformers")
    from lit_speed.monitoring.flops import device_peak_flops
    from lit_speed.run.runner import train
    from tests.helpers.tiny_hf import save_tiny_causal_lm, write_texts

    folder = save_tiny_causal_lm(tmp_path / "hf")
    (tmp_path / "texts").mkdir()
    texts = write_texts(tmp_path / "texts")
    summary = train(make_cfg(["model=hf_causal_lm", "data=text_folder", f"model.pretrained={folder}",
                              f"data.root={texts}", "data.block_size=32", "data.batch_size=2", "peft=lora",
                              "peft.base_dtype=bf16", "peft.base_compute=bf16", "precision=32-true",
                              "trainer.max_steps=4", "trainer.limit_val_batches=1", "logger=none", "validate=false",
                              "callbacks=[device_stats]", "callbacks.device_stats.interval=1",
                              "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]))
    stats = summary["components"]["DeviceStatsLogger"]
    mix = {getattr(torch, name): flops for name, flops in stats["flops_by_dtype"].items()}
    assert low_precision_share(mix) > 0.5  # the base's matmuls: bf16, although the precision is 32-true
    cpu = torch.device("cpu")
    assert stats["peak_flops"] == pytest.approx(step_peak_flops(mix, lambda d: device_peak_flops(cpu, d))[0])
    assert "torch.bfloat16" in stats["peak_flops_source"]
    assert 0 < stats["evidence"]["mfu"] <= 1.0
    assert "bf16-mixed" not in stats["next_step"]
