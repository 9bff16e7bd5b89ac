"""AccumulationScheduler under lit_speed's ZeroStrategy (DeepSpeed ZeRO-2 on CPU, one process).

Both runs use ``use_distributed_sampler=False`` so ZeRO (a distributed strategy) reads the data in the
same order as the single-device reference. Tolerance 1e-6 relative on the parameter update: the same
per-item gradients, summed in flat ZeRO buffers instead of per-parameter tensors (fp32 rounding only).
"""
from __future__ import annotations

import os

import pytest
from torch.utils.data import DataLoader

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from lit_speed.accumulation import AccumulationScheduler  # noqa: E402
from tests.helpers.accumulation import TinyTokenLM, rel_err, token_data, update  # noqa: E402

pytest.importorskip("deepspeed")
from lit_speed.strategies.zero_strategy import ZeroStrategy  # noqa: E402


@pytest.mark.slow  # DeepSpeed import + two ZeRO engine set-ups: ~40 s on a shared 2-core CPU
def test_schedule_changing_mid_run_under_zero2_matches_the_single_process_run():
    module, data = TinyTokenLM(), token_data(48)  # 6 micro-batches: steps of 1, 1, then windows of 2, 2

    def schedule() -> AccumulationScheduler:
        return AccumulationScheduler(factors={0: 1, 2: 2}, normalize="tokens")

    loader = DataLoader(data, batch_size=8)
    reference = update(module, loader, [schedule()], use_distributed_sampler=False)
    zero = update(module, loader, [schedule()], strategy=ZeroStrategy(stage=2), use_distributed_sampler=False)
    assert rel_err(zero, reference) <= 1e-6
    # the test can fail: without the callback's normalisation ZeRO averages micro-batch means
    plain = update(module, loader, strategy=ZeroStrategy(stage=2), use_distributed_sampler=False,
                   accumulate_grad_batches=2)
    assert rel_err(plain, reference) > 1e-2
