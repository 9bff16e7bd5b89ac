"""``attention=auto``'s timing: the step's own attention calls, run with each kernel (``attention_choice.py``).

The kernels compute the same attention; the rest of the step is the same whichever of them runs. So
:func:`choose_attention` does not time whole steps: it runs the model's forward once, on a copy and without gradients,
to see its ``scaled_dot_product_attention`` calls (how many, their scores, the first one's inputs), then times that
call's forward and backward with torch's pick and with the math kernel, interleaved, on copies of its own tensors;
the step's attention time is one call's median times the calls. On charlm_fast's fp32 path (Zen4, 2 threads) whole
steps took ~1 s to decide (10 rounds of two ~45 ms steps, the kernels 2-4% apart), a ~30 s race's 3%; its four
calls take about a millisecond a round. When the calls differ (shapes, dtypes, options), the whole step is timed with
each kernel instead. With ``precision=auto`` every mode's calls are timed this way first, then the modes as whole steps,
each with its faster kernel (``AttentionChoice.with_modes``): there the mode changes the rest of the step too.
"""
from __future__ import annotations

import math
import warnings
from contextlib import nullcontext
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from lit_speed.precision.step_timing import (
    ModeRun,
    as_step_input,
    detached_copy,
    loss_of,
    preserved_rng_states,
    step_key,
)
from lit_speed.tuning.measured_choice import Decision, measured_choice

#: ``auto`` leaves the math kernel untimed when the step's attention probabilities, kept for the backward, would
#: take more than this (bytes, counted at 8 per score: the scores and the probabilities, float32).
MATH_SAVED_CAP = 256 * 2**20
#: Rounds and seconds of the per-call timing: a round is one call per kernel (0.2-5 ms each at charlm's size).
CALL_ROUNDS = 30
CALL_BUDGET_S = 0.3
_QKV = ("query", "key", "value")


def _signature(args: tuple, kwargs: dict) -> tuple:
    def one(value: Any) -> Any:
        return (tuple(value.shape), str(value.dtype), str(value.device)) if isinstance(value, Tensor) else repr(value)
    return tuple(map(one, args)), tuple(sorted((k, one(v)) for k, v in kwargs.items()))


def _copied(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, Tensor) else value


class CountAttention(TorchFunctionMode):
    """Counts the ``scaled_dot_product_attention`` calls of a step and the scores they compute; with ``keep_first``,
    keeps a copy of the first call's inputs (``first``) and whether every call had its shapes and options (``alike``).
    """

    def __init__(self, keep_first: bool = False) -> None:
        super().__init__()
        self.calls = 0
        self.scores = 0  # query positions x key positions, over batch and heads, summed over the calls
        self.keep_first = keep_first
        self.first: tuple[tuple, dict] | None = None
        self.alike = True
        self._signature: tuple | None = None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            query, key = args[0] if args else kwargs["query"], args[1] if len(args) > 1 else kwargs["key"]
            self.calls += 1
            self.scores += math.prod(query.shape[:-1]) * key.shape[-2]
            signature = _signature(args, kwargs)
            if self._signature is None:
                self._signature = signature
                if self.keep_first:
                    self.first = tuple(map(_copied, args)), {k: _copied(v) for k, v in kwargs.items()}
            elif signature != self._signature:
                self.alike = False
        return func(*args, **kwargs)

    def math_saved_bytes(self) -> int:
        return 8 * self.scores


class AttentionCall:
    """One recorded ``scaled_dot_product_attention`` call, run again forward and backward in ``context`` (the step's
    autocast), its query, key and value leaves that need gradients as in a training step."""

    def __init__(self, first: tuple[tuple, dict], context: Callable[[], Any]) -> None:
        args, kwargs = first
        self.args = [a.requires_grad_(True) if i < 3 and isinstance(a, Tensor) and a.is_floating_point() else a
                     for i, a in enumerate(args)]
        self.kwargs = {k: v.requires_grad_(True) if k in _QKV and isinstance(v, Tensor) and v.is_floating_point()
                       else v for k, v in kwargs.items()}
        self.context = context
        self.grad: Tensor | None = None

    def run(self, kernel: str) -> None:
        with self.context(), sdpa_kernel([SDPBackend.MATH]) if kernel == "math" else nullcontext():
            out = F.scaled_dot_product_attention(*self.args, **self.kwargs)
        if self.grad is None:
            self.grad = torch.randn_like(out)
        torch.autograd.backward(out, self.grad)
        for leaf in [*self.args[:3], *(self.kwargs.get(k) for k in _QKV)]:
            if isinstance(leaf, Tensor):
                leaf.grad = None
        if out.device.type == "cuda":
            torch.cuda.synchronize()  # the call's kernels are in its time


def choose_attention(module: torch.nn.Module, batch: Any, mode: str, device: torch.device | None = None,
                     cap: int = MATH_SAVED_CAP) -> Decision:
    """Time this model's attention (in ``mode``) with torch's kernel and with the math kernel, interleaved, and pick
    one: torch's pick is kept unless math is faster by the tuning margin. Cached per machine; leaves no trace in the
    run (copies of the model and of the call's inputs, RNG states restored)."""
    name = "precision.attention"
    with preserved_rng_states(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step_input = as_step_input(module, batch, device)
        base = detached_copy(module)
        runs = {"default": ModeRun(base, mode, loss_of)}  # math's copy only if whole steps are to be timed
        with torch.no_grad(), runs["default"].context(), CountAttention(keep_first=True) as seen:
            loss_of(runs["default"].model, runs["default"].convert(step_input))
        if not seen.calls:
            return Decision(name, "default", "this model's step calls no scaled_dot_product_attention: not timed")
        if seen.math_saved_bytes() > cap:
            return Decision(name, "default", f"the math kernel would keep ~{seen.math_saved_bytes() / 2**20:,.0f} MiB "
                            f"of attention scores for the backward ({seen.calls} calls; over {cap / 2**20:.0f} MiB): "
                            "not timed, torch's pick kept")
        key = {**step_key(module, mode, step_input), "device": str(device or "cpu"),
               "timed": "calls" if seen.alike else "steps"}
        if seen.alike and seen.first is not None:
            call = AttentionCall(seen.first, runs["default"].context)
            decision = measured_choice(name, key, {k: (lambda k=k: call.run(k)) for k in ("default", "math")},
                                       default="default", rounds=CALL_ROUNDS, budget_s=CALL_BUDGET_S,
                                       scale={"default": seen.calls, "math": seen.calls})
            decision.reason = decision.reason.replace(
                "timed here: ", f"timed here, the step's {seen.calls} attention calls (forward and backward): ", 1)
            return decision
        runs["math"] = ModeRun(base, f"{mode}+math", loss_of)  # ModeRun's "+math": its steps run the math kernel
        decision = measured_choice(name, key, {k: (lambda k=k: runs[k].step(step_input)) for k in runs},
                                   default="default")
        decision.reason = decision.reason.replace("timed here: ", "timed here, whole steps (the calls differ): ", 1)
        return decision
