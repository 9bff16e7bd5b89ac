"""Pure-function tests of the device-stats core: verdict, time attribution, GPU sample reduction, FLOPs, peaks."""
from __future__ import annotations

import pytest
import torch

from lit_speed import GuardedPrecision
from lit_speed.monitoring.device_stats_logger import interval_metrics
from lit_speed.monitoring.diagnosis import (
    HEADROOM_GROW_FRAC,
    HEADROOM_TIGHT_FRAC,
    INPUT_BOUND_FRAC,
    OPTIMIZER_BOUND_FRAC,
    RunStats,
    diagnose,
    verdict_rows,
)
from lit_speed.monitoring.flops import FlopCount, contains_compiled, gpu_peak_flops, measure_cpu_peak_flops
from lit_speed.monitoring.samplers import summarize_gpu_samples
from lit_speed.monitoring.step_timer import StepTimer, TimeSplit, attribute
from lit_speed.precision.modes import compute_dtype

GIB = 2**30


def split_stats(data: float, fb: float, opt: float, **kw) -> RunStats:
    return RunStats(data_wait_s=data, forward_backward_s=fb, optimizer_s=opt, batches=100, **kw)


def test_input_bound_names_share_and_next_step():
    result = diagnose(split_stats(4.6, 4.0, 1.4))
    assert result["verdict"] == "input-bound"
    assert result["summary"] == "input-bound: 46% of step time waiting for data"
    assert "data.num_workers" in result["next_step"]
    assert result["evidence"]["data_wait_frac"] == pytest.approx(0.46)
    assert result["evidence"]["step_time_ms"] == pytest.approx(1000 * 10.0 / 100)


def test_optimizer_bound_advice_depends_on_device():
    cpu = diagnose(split_stats(0.2, 6.0, 3.8))
    gpu = diagnose(split_stats(0.2, 6.0, 3.8, device="cuda", gpu_util_pct=95.0))
    assert cpu["verdict"] == gpu["verdict"] == "optimizer-bound"
    assert cpu["summary"] == "optimizer-bound: 38% of step time in optimizer.step"
    assert "adamw_fused" in cpu["next_step"] and "zero2_offload" not in cpu["next_step"]
    assert "zero2_offload" in gpu["next_step"]


def test_larger_of_two_bottlenecks_wins_and_the_other_is_kept():
    result = diagnose(split_stats(3.0, 3.0, 4.0))
    assert [f["kind"] for f in result["findings"]] == ["optimizer-bound", "input-bound"]
    assert diagnose(split_stats(4.0, 3.0, 3.0))["verdict"] == "input-bound"


def test_thresholds_are_inclusive_boundaries():
    just_input = INPUT_BOUND_FRAC
    assert diagnose(split_stats(just_input, 1 - just_input, 0.0))["verdict"] == "input-bound"
    below = INPUT_BOUND_FRAC - 0.01
    assert diagnose(split_stats(below, 1 - below, 0.0))["verdict"] == "compute-bound"
    below_opt = OPTIMIZER_BOUND_FRAC - 0.01
    assert diagnose(split_stats(0.0, 1 - below_opt, below_opt))["verdict"] == "compute-bound"


def test_compute_bound_advice_follows_mfu():
    low = diagnose(split_stats(0.05, 0.9, 0.05, mfu=0.1))
    high = diagnose(split_stats(0.05, 0.9, 0.05, mfu=0.6))
    assert low["verdict"] == high["verdict"] == "compute-bound"
    assert low["summary"] == "compute-bound: 90% of step time in forward+backward at 10% MFU"
    assert "larger micro-batch" in low["next_step"]
    assert "bf16-mixed" in high["next_step"]


def test_idle_gpu_without_data_wait_is_host_bound():
    result = diagnose(split_stats(0.05, 0.9, 0.05, device="cuda", gpu_util_pct=35.0))
    assert result["verdict"] == "host-bound"
    assert "35%" in result["summary"] and "torch.compile" in result["next_step"]
    # the same utilisation on CPU means nothing: no GPU reading, plain compute-bound
    assert diagnose(split_stats(0.05, 0.9, 0.05, gpu_util_pct=35.0))["verdict"] == "compute-bound"


@pytest.mark.parametrize(("peak_gib", "kind"), [(3.0, "memory-headroom"), (6.0, "memory-ok"), (9.5, "memory-tight")])
def test_memory_finding(peak_gib, kind):
    result = diagnose(split_stats(0.1, 0.8, 0.1, memory_peak_bytes=peak_gib * GIB, memory_capacity_bytes=10 * GIB))
    assert result["verdict"] == "compute-bound"  # memory is reported, never the verdict
    memory = result["findings"][-1]
    assert memory["kind"] == kind
    headroom = 1 - peak_gib / 10
    assert result["evidence"]["memory_headroom_frac"] == pytest.approx(headroom)
    assert f"{100 * headroom:.0f}%" in memory["message"]
    assert (headroom >= HEADROOM_GROW_FRAC) == (kind == "memory-headroom")
    assert (headroom < HEADROOM_TIGHT_FRAC) == (kind == "memory-tight")


def test_nothing_timed_is_unknown():
    result = diagnose(RunStats(data_wait_s=0.0, forward_backward_s=0.0, optimizer_s=0.0, batches=0))
    assert result["verdict"] == "unknown" and result["findings"] == []


def test_verdict_rows_carry_split_compute_and_secondary_findings():
    result = diagnose(split_stats(3.0, 3.0, 4.0, mfu=0.25, flops_per_sec=2.5e10,
                                  memory_peak_bytes=1 * GIB, memory_capacity_bytes=10 * GIB))
    rows = verdict_rows(result)
    assert rows["verdict"] == result["summary"]
    assert rows["time split"].startswith("data wait 30% | forward+backward 30% | optimizer 40% (100 batches")
    assert rows["compute"] == "0.0250 TFLOP/s, MFU 25.0%"
    assert set(rows) >= {"next step", "input-bound", "memory-headroom"}


def test_attribution_of_gaps():
    assert attribute("batch_end", "batch_start") == "data_wait"
    assert attribute("batch_start", "before_optimizer") == "forward_backward"
    assert attribute("before_optimizer", "batch_end") == "optimizer"
    assert attribute("batch_start", "batch_end") == "forward_backward"  # accumulating batch: no step
    with pytest.raises(ValueError, match=r"mark must be one of \('batch_start', 'before_optimizer', 'batch_end'\), got 'x'"):
        attribute("batch_end", "x")


def test_step_timer_splits_pauses_and_keeps_the_open_mark():
    now = [0.0]
    timer = StepTimer(clock=lambda: now[0])

    def at(t: float, label: str) -> None:
        now[0] = t
        timer.mark(label)

    at(0.0, "batch_end")
    at(1.0, "batch_start"), at(3.0, "before_optimizer"), at(3.5, "batch_end")  # wait 1, fb 2, opt 0.5
    timer.pause()  # validation: the gap up to the next mark is dropped
    at(10.0, "batch_start"), at(12.0, "batch_end")  # accumulating batch: fb 2
    split = timer.flush()
    assert (split.data_wait_s, split.forward_backward_s, split.optimizer_s, split.batches) == (1.0, 4.0, 0.5, 2)
    at(12.25, "batch_start")  # the gap from the kept last mark is the next interval's data wait
    assert timer.flush().data_wait_s == 0.25
    assert TimeSplit(1.0, 2.0, 1.0, 1).fractions() == {"data_wait": 0.25, "forward_backward": 0.5, "optimizer": 0.25}


def test_interval_metrics_units_are_consistent():
    split = TimeSplit(data_wait_s=0.5, forward_backward_s=1.0, optimizer_s=0.5, batches=10)
    m = interval_metrics(split, samples=640, tokens=0, flops_per_batch=1e9, peak_flops=2e10)
    assert m["time/batch_ms"] == pytest.approx(200.0)
    assert m["throughput/samples_per_sec"] * m["time/batch_ms"] / 1000 == pytest.approx(64)  # samples per batch
    assert m["perf/tflops_per_sec"] == pytest.approx(1e9 * 10 / 2.0 / 1e12)
    assert m["perf/mfu"] == pytest.approx(m["perf/tflops_per_sec"] * 1e12 / 2e10)
    assert "throughput/tokens_per_sec" not in m
    assert interval_metrics(TimeSplit(), 0, 0, None, None) == {}


def test_gpu_samples_reduce_to_mean_util_power_and_max_memory_heat():
    samples = [{"util_pct": 40.0, "mem_used_bytes": 1e9, "mem_total_bytes": 8e9, "power_w": 100.0, "temp_c": 60.0},
               {"util_pct": 80.0, "mem_used_bytes": 3e9, "mem_total_bytes": 8e9, "temp_c": 70.0}]  # no power
    out = summarize_gpu_samples(samples)
    assert out == {"stats/gpu_util_pct": 60.0, "stats/gpu_mem_used_bytes": 3e9, "stats/gpu_mem_total_bytes": 8e9,
                   "stats/gpu_power_w": 100.0, "stats/gpu_temp_c": 70.0}
    assert summarize_gpu_samples([]) == {}


def test_flop_count_matches_linear_formula():
    batch, d_in, d_out = 8, 64, 32
    layer = torch.nn.Linear(d_in, d_out)
    x = torch.randn(batch, d_in, requires_grad=True)
    counter = FlopCount()
    counter.start()
    assert counter.active
    layer(x).sum().backward()
    # forward, grad of input, grad of weight: three (batch x d_in x d_out) matmuls of 2 FLOPs per multiply-add
    assert counter.stop() == 3 * 2 * batch * d_in * d_out
    assert not counter.active and counter.stop() == 0


def test_flop_count_equals_torch_counter_and_keeps_checkpointed_activations_out_of_backward():
    # FlopCounterMode's module tracker kept the recomputed activations of checkpointed decoder layers alive through
    # backward (x1.6 here; the 1B-dims LoRA run's first batch: RSS 7.7 -> 14.2 GiB); the plain counter must count the
    # same FLOPs and hold nothing
    transformers = pytest.importorskip("transformers")
    from torch.utils.flop_counter import FlopCounterMode

    from lit_speed.memory.activation_checkpointing import checkpoint_modules
    from lit_speed.memory.memory_tracker import LiveTensorTracker

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256))
    checkpoint_modules(model, ["decoder-layers"])
    model.train()
    ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0))

    def step(counter: str) -> tuple[int, int]:
        torch_mode, ours = FlopCounterMode(display=False), FlopCount()
        with LiveTensorTracker() as tracker:
            if counter == "torch":
                torch_mode.__enter__()
            elif counter == "ours":
                ours.start()
            model(input_ids=ids, labels=ids).loss.backward()
            if counter == "torch":
                torch_mode.__exit__(None, None, None)
        model.zero_grad(set_to_none=True)
        return (torch_mode.get_total_flops() if counter == "torch" else ours.stop()), tracker.peak_bytes

    _, plain_peak = step("none")
    torch_flops, torch_peak = step("torch")
    flops, peak = step("ours")
    # ours also counts the CPU's fused attention, which torch has no formula for: forward twice (the checkpointed
    # layers recompute it in backward) and backward, per layer, with every query head (grouped-query attention)
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    q = (2, 4, 128, 32)
    attention = 4 * (2 * sdpa_flop_count(q, q, q) + sdpa_backward_flop_count(q, q, q, q))
    assert flops == torch_flops + attention and torch_flops > 0
    assert peak == plain_peak and torch_peak > 1.3 * plain_peak  # ours adds nothing; torch's tracker did


def _attention_flops(q_heads: int, kv_heads: int) -> tuple[int, str | None]:
    """One causal SDPA forward and backward on the CPU under FlopCount (grouped-query when ``kv_heads`` < ``q_heads``)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, q_heads, 16, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, 16, 8, generator=g, requires_grad=True) for _ in range(2))
    counter = FlopCount()
    counter.start()
    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != q_heads
                                                     ).square().sum().backward()
    return counter.stop(), counter.error


def test_cpu_attention_is_counted_as_torch_counts_the_cuda_kernels():
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    flops, error = _attention_flops(4, 4)
    shape = (2, 4, 16, 8)
    assert error is None and flops == sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(*[shape] * 4) > 0


def test_grouped_query_attention_is_counted_where_torch_formulas_assert(monkeypatch):
    # torch <= 2.11's attention formulas assert when key/value have fewer heads than the query (found on an H200:
    # Qwen2.5-0.5B-dims LoRA, eager, transformers' SDPA with enable_gqa on CUDA, and the default device stats logger
    # crashed the first step). The stand-in: today's formulas, asserting as those did
    from torch.utils import flop_counter

    raised = []

    def asserting(formula):
        def old(*shapes):
            if len({shape[1] for shape in shapes if len(shape) == 4}) > 1:
                raised.append(formula.__name__)
                raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")
            return formula(*shapes)
        return old

    dense, _ = _attention_flops(4, 4)
    monkeypatch.setattr(flop_counter, "sdpa_flop_count", asserting(flop_counter.sdpa_flop_count))
    monkeypatch.setattr(flop_counter, "sdpa_backward_flop_count", asserting(flop_counter.sdpa_backward_flop_count))
    grouped, error = _attention_flops(4, 2)
    assert raised == ["sdpa_flop_count", "sdpa_backward_flop_count"]  # the old formulas were reached, and asserted
    assert error is None and grouped == dense  # every query head counted, as the kernel computes it


def test_a_failing_flop_formula_stops_the_count_not_the_step(monkeypatch):
    from torch.utils.flop_counter import flop_registry

    def broken(*args, **kwargs):
        raise RuntimeError("no formula for this layout")

    monkeypatch.setitem(flop_registry, torch.ops.aten.mm, broken)
    monkeypatch.setitem(flop_registry, torch.ops.aten.bmm, broken)
    linear = torch.nn.Linear(8, 8)
    counter = FlopCount()
    counter.start()
    linear(torch.ones(3, 8)).sum().backward()
    assert counter.stop() == 0 and "aten.mm: RuntimeError: no formula for this layout" in counter.error
    assert torch.equal(linear.weight.grad, torch.full((8, 8), 3.0))  # the step ran to the end


def test_compute_dtype_follows_lightning_precision():
    assert compute_dtype("32-true") is torch.float32
    assert compute_dtype("bf16-mixed") is torch.bfloat16
    assert compute_dtype("16-mixed") is torch.float16
    # issue 25: on CPU a plugin that says 16-mixed runs fp16 autocast (GuardedPrecision does; Lightning's Trainer turns
    # precision="16-mixed" on CPU into a "bf16-mixed" plugin), so MFU's CPU peak is fp16's, as for the slowness probe
    assert compute_dtype("16-mixed") is GuardedPrecision("16-mixed")._spec.autocast_dtype is torch.float16


def test_gpu_peak_table_matches_most_specific_name_first():
    # dense datasheet numbers (NVIDIA A100 / H100 / L4 / L40S / T4 datasheets)
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", torch.bfloat16) == 312e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", torch.float32) == 19.5e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", torch.float32, tf32=True) == 156e12
    assert gpu_peak_flops("NVIDIA H100 PCIe", torch.bfloat16) == 756e12
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989.4e12
    assert gpu_peak_flops("NVIDIA L40S", torch.bfloat16) == 362e12
    assert gpu_peak_flops("NVIDIA L4", torch.bfloat16) == 121e12
    assert gpu_peak_flops("Tesla T4", torch.bfloat16) is None  # no bf16 units
    assert gpu_peak_flops("Some Future GPU", torch.float32) is None


def test_cpu_peak_probe_is_positive_and_cached():
    first = measure_cpu_peak_flops(torch.float32, size=256, seconds=0.05)
    assert first > 0
    assert measure_cpu_peak_flops(torch.float32, size=256, seconds=0.05) == first  # cached, not re-measured


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"size": 8}, r"size must be >= 64 .* got 8"),
    ({"seconds": 0}, r"seconds must be > 0, got 0"),
])
def test_cpu_peak_probe_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        measure_cpu_peak_flops(**kwargs)


def test_compiled_models_are_recognised_so_flops_are_not_counted_under_compile():
    # nn.Module.compile() only marks the module; nothing is compiled until it is called, so this is cheap
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    assert not contains_compiled(model)
    model[1].compile()
    assert contains_compiled(model), "torch changed where nn.Module.compile() keeps the compiled call"
    assert contains_compiled(torch.compile(torch.nn.Linear(4, 4)))
