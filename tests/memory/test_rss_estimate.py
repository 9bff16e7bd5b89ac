"""The real-size RSS estimate: a step probed at 1-2 layers, two small vocabularies and two short windows carries to a
model of many layers, a large vocabulary and long windows (checked against the step measured directly at that size),
and the parts add up as documented."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from lit_speed.memory.memory_tracker import LiveTensorTracker
from lit_speed.memory.model_state import parameter_counts
from lit_speed.memory.rss_estimate import (
    ALLOCATOR_SLACK,
    ScaledProbe,
    load_peak_bytes,
    predict_peak_rss,
    probe_scaled,
)


class ToyLM(nn.Module):
    """Embedding, ``layers`` residual MLP blocks, an untied head: activations linear in layers and tokens, logits
    linear in vocabulary and tokens."""

    def __init__(self, layers: int, vocab: int, width: int = 32):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                                    for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def step(model, ids):
    logits = model(ids)
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


def measured(layers, vocab, tokens):
    model = ToyLM(layers, vocab)
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(1))
    with LiveTensorTracker() as tracker:
        step(model, ids).backward()
    return tracker.peak_bytes


@pytest.mark.parametrize(("layers", "vocab", "tokens"), [(12, 8192, 512), (4, 30_000, 256)])
def test_a_probe_at_two_layers_and_small_vocabularies_predicts_the_step_of_a_big_model(layers, vocab, tokens):
    fit = probe_scaled(lambda n_layers, n_vocab: ToyLM(n_layers, n_vocab), step)
    predicted, actual = fit.step_bytes(layers, vocab, tokens), measured(layers, vocab, tokens)
    # the same kernels at every size: the fit is exact up to allocation granularity
    assert predicted == pytest.approx(actual, rel=0.05), (predicted, actual)


def test_the_estimate_adds_process_weights_state_and_the_larger_of_step_and_optimizer_step():
    probe = ScaledProbe(const=(1000.0, 0.0, 0.0), per_token=(10.0, 0.0, 0.0))
    est = predict_peak_rss(process=10_000, frozen_params=100, frozen_bytes=2, trainable_params=50, trainable_bytes=4,
                           state_bytes_per_param=8, step_temp_per_param=0, probe=probe, layers=1, vocab=1, tokens=100,
                           load_bytes=0)
    assert (est.weights, est.optimizer, est.step, est.optimizer_step) == (400, 400, 2000, 200)
    assert est.peak == est.training_peak == int(10_000 + (400 + 400 + 2000) * ALLOCATOR_SLACK)
    heavy_load = predict_peak_rss(process=10_000, frozen_params=100, frozen_bytes=2, trainable_params=50,
                                  trainable_bytes=4, state_bytes_per_param=8, step_temp_per_param=0, probe=probe,
                                  layers=1, vocab=1, tokens=100, load_bytes=50_000)
    assert heavy_load.peak == 60_000  # reading the weights can be the peak of a short run


def test_the_previous_steps_gradients_count_beside_the_forward():
    # Lightning's closure runs training_step before zero_grad: from the second step on, the forward runs while the
    # last step's gradients are alive. A forward of 1,900 B (backward adds 100) beside 2,000 B of gradients is a
    # 3,900 B step, not the probe's 2,000 (the 50M Qwen2 full fine-tune was predicted at x0.83 of its peak RSS)
    probe = ScaledProbe(const=(0.0, 0.0, 0.0), per_token=(20.0, 0.0, 0.0), forward_per_token=(19.0, 0.0, 0.0),
                        backward_extra=(100.0, 0.0, 0.0))
    est = predict_peak_rss(process=0, frozen_params=0, frozen_bytes=2, trainable_params=500, trainable_bytes=4,
                           state_bytes_per_param=8, step_temp_per_param=0, probe=probe, layers=1, vocab=1, tokens=100,
                           load_bytes=0)
    assert probe.step_bytes(1, 1, 100) == 2000 and probe.forward_bytes(1, 1, 100) == 1900
    assert est.step == 2000 + 1900
    lora = predict_peak_rss(process=0, frozen_params=0, frozen_bytes=2, trainable_params=5, trainable_bytes=4,
                            state_bytes_per_param=8, step_temp_per_param=0, probe=probe, layers=1, vocab=1, tokens=100,
                            load_bytes=0)
    assert lora.step == 2000  # few gradients: the step's own peak (backward's) stays the larger


def test_load_peak_counts_the_file_only_when_the_dtype_changes_on_the_way():
    assert load_peak_bytes(file_bytes=200, params=100, load_dtype_bytes=4, file_dtype_bytes=2) == 600
    assert load_peak_bytes(file_bytes=200, params=100, load_dtype_bytes=2, file_dtype_bytes=2) == 200


def test_tied_parameters_count_once():
    model = ToyLM(1, 50)
    model.head.weight = model.embed.weight
    model.blocks.requires_grad_(False)
    trainable, frozen = parameter_counts(model)
    assert trainable == 50 * 32 + 50  # the tied embedding/head once, the head's bias
    assert frozen == sum(p.numel() for p in model.blocks.parameters())


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="PeakRSS reads /proc/self/statm (Linux)")
def test_peak_rss_sees_a_block_that_is_gone_when_it_ends():
    """The probe's own peak (RSSEstimate.check): 256 MiB touched and freed inside the block raise its peak by about
    that much, while the RSS after it is back down."""
    import psutil

    from lit_speed.memory.rss_estimate import PeakRSS

    size = 256 * 2**20
    with PeakRSS() as seen:
        start = psutil.Process().memory_info().rss
        block = torch.ones(size // 4)  # written: its pages are resident
        time_held = torch.randn(64, 64) @ torch.randn(64, 64)  # a few ms of work while it is held
        del block, time_held
    after = psutil.Process().memory_info().rss
    assert seen.peak >= start + 0.9 * size
    assert after < seen.peak - 0.5 * size  # freed (glibc returns a block this large at once)


def test_the_probes_peak_counts_in_the_estimate_and_not_in_a_tensors_only_one():
    from lit_speed.memory.rss_estimate import RSSEstimate

    parts = dict(process=100, weights=10, optimizer=1, step=5, optimizer_step=2, load=20, export=0)
    assert RSSEstimate(**parts, check=500).peak == 500
    assert RSSEstimate(**parts, check=50).peak == RSSEstimate(**parts).peak
