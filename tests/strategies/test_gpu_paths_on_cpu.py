"""Logic of GPU-only paths, run on the CPU through honest stand-ins: CUDA-event timing and CUDA OOM recovery.

The NVML sampler has its own file (``tests/monitoring/test_samplers.py``); DeepSpeed's accelerator choice is in
``test_ds_accelerator.py``. The real-device versions are marked ``gpu`` and skipped here.
"""
from __future__ import annotations

import pytest
import torch

from lit_speed.monitoring.step_timer import StepTimer
from lit_speed.oom import is_oom_error


class FakeCudaEvent:
    """``torch.cuda.Event(enable_timing=True)`` semantics: ``record`` stamps the stream's (here: a given)
    time, ``elapsed_time`` answers in milliseconds, and only ``synchronize`` waits for the device."""

    now_ms = 0.0
    synchronized: list["FakeCudaEvent"] = []

    def __init__(self) -> None:
        self.at_ms: float | None = None

    def record(self) -> None:
        self.at_ms = FakeCudaEvent.now_ms

    def synchronize(self) -> None:
        FakeCudaEvent.synchronized.append(self)

    def elapsed_time(self, end: "FakeCudaEvent") -> float:
        assert FakeCudaEvent.synchronized, "elapsed_time before any synchronize: torch raises here on a GPU"
        return end.at_ms - self.at_ms


def test_cuda_event_timer_gives_the_cpu_timer_split_and_syncs_once_per_flush() -> None:
    FakeCudaEvent.synchronized = []
    now = [0.0]
    cpu = StepTimer(clock=lambda: now[0])
    cuda = StepTimer(cuda=True, event_factory=FakeCudaEvent)

    def at(t: float, label: str) -> None:  # the same marks, in seconds for the CPU, milliseconds on the GPU
        now[0], FakeCudaEvent.now_ms = t, 1000.0 * t
        cpu.mark(label), cuda.mark(label)

    at(0.0, "batch_end")
    at(1.0, "batch_start"), at(3.0, "before_optimizer"), at(3.5, "batch_end")
    cuda.pause(), cpu.pause()
    at(10.0, "batch_start"), at(12.0, "batch_end")
    assert FakeCudaEvent.synchronized == []  # marking never waits for the device
    split = cuda.flush()
    assert split == cpu.flush()
    assert (split.data_wait_s, split.forward_backward_s, split.optimizer_s, split.batches) == (1.0, 4.0, 0.5, 2)
    assert len(FakeCudaEvent.synchronized) == 1 and FakeCudaEvent.synchronized[0].at_ms == 12_000.0  # the newest
    at(12.25, "batch_start")
    assert cuda.flush().data_wait_s == pytest.approx(0.25) == cpu.flush().data_wait_s
    assert len(FakeCudaEvent.synchronized) == 2


def test_torch_cuda_oom_is_what_recovery_catches() -> None:
    # AccumulationScheduler's recovery (tests/accumulation/test_accumulation_scheduler.py::
    # test_injected_oom_mid_window_retries_with_half_micro_batch_without_losing_a_step) is driven by a raised
    # torch.OutOfMemoryError; the allocator raises torch.cuda.OutOfMemoryError, which must be the same class for
    # that test to stand for a real CUDA OOM.
    assert torch.cuda.OutOfMemoryError is torch.OutOfMemoryError
    assert issubclass(torch.cuda.OutOfMemoryError, RuntimeError)  # the scheduler's `except RuntimeError`
    error = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                                        "of 79.10 GiB of which 1.12 GiB is free.")
    assert is_oom_error(error)


def test_cuda_oom_in_a_real_fit_retries_the_window_with_half_the_micro_batch() -> None:
    from torch.utils.data import DataLoader

    from lit_speed.accumulation.accumulation_scheduler import AccumulationScheduler
    from tests.helpers.accumulation import TinyClassifier, classification_data, fit

    class CudaOOMOnce(TinyClassifier):
        """Raises what the CUDA caching allocator raises, once, on the second micro-batch of the last window."""

        def training_step(self, batch, batch_idx):
            if batch_idx == 5 and not self.oom_raised and len(batch[0]) > 4:
                self.oom_raised = True
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return super().training_step(batch, batch_idx)

    module, callback = CudaOOMOnce(), AccumulationScheduler(factors={0: 2})
    trainer = fit(module, DataLoader(classification_data(48), batch_size=8), [callback])
    assert module.oom_raised and trainer.global_step == 3
    assert [size for step, size in module.seen_batch_sizes if step == 2] == [8, 4, 4, 4, 4]
    assert callback.final_summary()["micro_batch"] == 4
