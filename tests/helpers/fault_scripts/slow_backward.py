"""A tiny model whose backward pass is long and holds the main thread the way a large model's C++ backward does.

``model._target_=tests.helpers.fault_scripts.slow_backward.SlowBackwardMLP +model.slow_from_step=12
+model.slow_seconds=300`` trains the digits MLP with an identity autograd function on its logits whose backward, from
optimizer step 12 on, prints ``slow backward of step 13 begins`` and keeps the main thread busy for 300 s.

Why not a plain ``time.sleep`` there: the kernel would deliver a SIGTERM to the sleeping main thread, Python would
interrupt the sleep and run the Python-level handler at once, which no long kernel allows. So the stop signals are
blocked in the main thread for the duration (``pthread_sigmask``): the kernel hands a SIGTERM to another thread, whose
C-level handler records it, and the Python handler waits until the backward returns, as it does behind a kernel.
"""
from __future__ import annotations

import signal
import time
from typing import Any

import torch

from lit_speed.models.mlp import MLPClassifier

STOP_SIGNALS = {signal.SIGTERM, signal.SIGUSR1}


def hold_main_thread(seconds: float) -> None:
    """Busy the calling thread for ``seconds`` without running Python signal handlers (a long C call's effect)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        time.sleep(seconds)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class _SlowBackward(torch.autograd.Function):
    """Identity forward; a backward that holds the main thread when ``module`` says the step is a slow one."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, module: "SlowBackwardMLP") -> torch.Tensor:
        ctx.module = module
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        module = ctx.module
        step = module.trainer.global_step
        if step >= module.slow_from_step:
            print(f"slow backward of step {step + 1} begins", flush=True)
            hold_main_thread(module.slow_seconds)
        return grad, None


class SlowBackwardMLP(MLPClassifier):
    """:class:`~lit_speed.models.mlp.MLPClassifier` whose backward takes ``slow_seconds`` from ``slow_from_step``."""

    def __init__(self, *args: Any, slow_from_step: int = 10**9, slow_seconds: float = 0.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.slow_from_step, self.slow_seconds = slow_from_step, slow_seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        return _SlowBackward.apply(logits, self) if torch.is_grad_enabled() and self.training else logits
