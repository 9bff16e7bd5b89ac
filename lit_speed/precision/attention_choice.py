"""The attention kernel of a run: torch's pick, one named kernel, or timed on the model's first training batch.

``F.scaled_dot_product_attention`` has several kernels per device (CPU: a flash kernel and the math composition of
matmuls and a softmax; CUDA: flash, memory-efficient, cuDNN and math) and torch picks one by rule, not by speed.
On a Zen5 (torch 2.13, 2 threads) the CPU flash kernel's backward in bf16 took 2.9 ms per call for charlm's
12 x 4 heads x 64 x 32 attention (its forward 0.41 ms): 45% of the 0.8M-parameter GPT's step. With the math
kernel that step took 19 ms instead of 24.5 ms in bf16-mixed, while in float32 flash was the faster (28.5 vs
32 ms): which kernel is faster depends on the dtype, the shapes and the CPU. ``attention="auto"`` times this
model's attention calls (forward and backward, on copies of the step's own inputs: the rest of the step is the same
with either kernel, :mod:`.attention_timing`) with torch's pick and with the math kernel, in the precision mode the
run uses, keeps torch's pick unless math is faster by the tuning margin, caches the timings per machine and
checkpoints the choice (a resume keeps it). When ``precision=auto`` times its modes too, each mode's attention calls
are timed first and each mode is then timed, as whole steps, with its own faster kernel: the (mode, kernel) pair is
chosen together. Timed apart, each choice saw the other's first guess (Zen4, charlm: the modes tied with torch's
kernel, 32-true 50.7 ms and bf16-master 48.8 ms a step, while bf16-master with math took 35.9 ms); timed as every
(mode, kernel) pair, six whole-step candidates shared the 1.5 s budget. The kernels compute the same attention; their
summation order differs, as between any two kernels.

The math kernel materialises the ``L x S`` attention probabilities and autograd keeps them for the backward: at
real sizes that is gigabytes (Qwen2.5-0.5B's dims, 4 x 512 tokens: ~2.6 GiB over 24 layers). ``auto`` does not time
it when the step's calls would keep more than
:data:`~lit_speed.precision.attention_timing.MATH_SAVED_CAP`, and says so.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Sequence

from lightning.pytorch.utilities import rank_zero_info
from torch.nn.attention import SDPBackend, sdpa_kernel

from lit_speed.precision.thread_choice import timed_or_kept
from lit_speed.tuning import on_rank_zero

#: The kernels a run may name (``torch.nn.attention.SDPBackend``); ``default`` is torch's own pick.
KERNELS = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
           "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
CPU_KERNELS = ("math", "flash")


class AttentionChoice:
    """``attention``: ``None`` (torch's pick), ``"auto"``, or a kernel: ``math``, ``flash``, ``efficient``, ``cudnn``.

    Raises:
        ValueError: Any other value, naming the setting and the fix.
    """

    def __init__(self, attention: str | None) -> None:
        if not (attention is None or attention == "auto" or attention in KERNELS):
            raise ValueError(f"GuardedPrecision(attention={attention!r}): one of auto, {', '.join(KERNELS)} or None "
                             "(torch's pick). Fix: attention=auto (timed on this model's step) or attention=null")
        self.requested = attention
        self.chosen = attention if attention in KERNELS else "default"
        self.reason = "requested" if attention in KERNELS else "torch's pick"
        self.pending = attention == "auto"  # timed on the first training batch
        self.per_mode: dict[str, Any] = {}  # precision=auto's modes -> their attention Decision (with_modes)

    def check_device(self, device_type: str) -> None:
        """A named kernel the device has no such kernel for is refused at setup, not at the first forward."""
        if device_type == "cpu" and self.requested in KERNELS and self.requested not in CPU_KERNELS:
            raise ValueError(f"GuardedPrecision(attention={self.requested!r}): the {self.requested} kernel is "
                             f"CUDA-only; this run trains on the CPU. Fix: attention={' or '.join(CPU_KERNELS)}, "
                             "auto (timed here) or null (torch's pick)")

    def context(self) -> AbstractContextManager:
        """Entered around every forward (``GuardedPrecision.forward_context``): the backward follows the forward's
        kernel, so the forward is where the choice is made."""
        return sdpa_kernel([KERNELS[self.chosen]]) if self.chosen in KERNELS else nullcontext()

    def decide(self, trainer: Any, batch: Any, mode: str) -> None:
        """``attention="auto"``: rank 0 times the step with each kernel, every rank uses its choice."""
        from lit_speed.precision.attention_timing import choose_attention

        self.pending = False
        self.chosen, self.reason = on_rank_zero(lambda: timed_or_kept(
            lambda: choose_attention(trainer.lightning_module, batch, mode, trainer.strategy.root_device),
            "default", "kept torch's pick"), trainer)
        rank_zero_info(f"GuardedPrecision: attention=auto -> {self.shown()} ({self.reason})")

    def with_modes(self, module: Any, batch: Any, modes: Sequence[str], device: Any) -> list[str]:
        """``precision=auto``'s candidate modes, each with its own faster kernel while this setting is ``auto`` and
        undecided: every mode's attention calls are timed first (:func:`~lit_speed.precision.attention_timing.
        choose_attention`, a fraction of a step each) and a mode whose calls run faster with math is timed as
        ``"<mode>+math"``, so the whole-step timing of the modes decides the pair (:meth:`take_joint`) with one
        candidate per mode. Which kernel is faster depends on the dtype (Zen4, charlm: bf16-master with torch's
        pick 49.6 ms a step, with math 35.9, 32-true 50.7): a mode timed with one kernel is not the mode's speed.
        Only ``modes`` (the kernel then decided alone, in the chosen mode) when a mode's calls were not timed."""
        from lit_speed.precision.attention_timing import choose_attention

        self.per_mode = {}
        if not self.pending:
            return list(modes)
        decisions = {}
        for mode in modes:
            try:
                decisions[mode] = choose_attention(module, batch, mode, device)
            except Exception:  # noqa: BLE001 - a step this timer cannot run: the kernel is decided alone later
                return list(modes)
            if not decisions[mode].times:  # no attention calls, or math over the cap: decided alone later
                return list(modes)
        self.per_mode = decisions
        return [mode if d.chosen == "default" else f"{mode}+{d.chosen}" for mode, d in decisions.items()]

    def per_mode_line(self) -> str:
        """What :meth:`with_modes` timed, for the precision decision's reason (empty when it timed nothing)."""
        return "".join(f"; {mode}'s attention: {d.chosen} ({d.reason})" for mode, d in self.per_mode.items())

    def take_joint(self, chosen: str, reason: str) -> str:
        """The mode of ``precision=auto``'s decision ``chosen``; a ``"<mode>+<kernel>"`` one decides the kernel too."""
        mode, joint, kernel = chosen.partition("+")
        if joint:
            self.chosen, self.pending = kernel, False
            self.reason = f"timed together with the precision modes: {reason}"
            rank_zero_info(f"GuardedPrecision: attention=auto -> {self.shown()} (timed with precision=auto's modes)")
        return mode

    def shown(self) -> str:
        return "torch's pick" if self.chosen == "default" else f"{self.chosen} kernel"

    def describe(self) -> str:
        if self.pending:
            return ("auto: times this model's attention calls with torch's pick and the math kernel on the first "
                    "training batch (in each mode precision=auto times, when it times them)")
        return f"{self.shown()} ({self.reason})"

    def state_dict(self) -> dict[str, Any]:
        return {"attention": self.chosen, "attention_reason": self.reason} if self.requested is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resume keeps the checkpoint's kernel when this run asks for ``auto`` (not timed again)."""
        if self.requested == "auto" and state.get("attention") in ("default", *KERNELS):
            self.chosen, self.pending = state["attention"], False
            self.reason = f"restored from the checkpoint (not timed again): {state.get('attention_reason', '')}"
