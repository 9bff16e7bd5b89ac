"""Will it fit in this machine's RAM? The process's peak RSS of a run, predicted before the weights are loaded.

The planner (:mod:`lit_speed.memory.planner`) runs the real module at several sizes: right for a 1-10M parameter
model, minutes for a 0.5B one. At real size the estimate is built from parts instead:

* **the process**: its RSS before the model exists (Python, torch, Lightning, transformers: measured, not assumed);
* **model state**: parameters by dtype (a frozen base held in bf16 counts 2 bytes), float32 gradients of what
  trains, the optimizer's declared state bytes per parameter and the temporaries of one step, from exact parameter
  counts (the architecture built on the meta device: no weights are read);
* **the step's tensors** (activations, logits and their gradients, the gradients produced during backward), from a
  **scaled probe**: the same architecture at the real width with 1-2 layers, two small vocabularies and two short
  windows, prepared as the run prepares it (adapters, a low-precision base, chunked loss, checkpointing, precision)
  and measured with :class:`~lit_speed.memory.memory_tracker.LiveTensorTracker`; a fit linear in layers,
  vocabulary and tokens carries the measurement to the real size;
* **allocator slack**: freed memory the C allocator keeps (:data:`ALLOCATOR_SLACK`, measured against peak RSS).

:func:`predict_peak_rss` adds them up; ``scripts/plan.py`` and the runner's pre-flight (``lit_speed.run``) use it.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from lit_speed.memory.memory_tracker import LiveTensorTracker, SkipMatmuls

#: Peak RSS over (process + model state + the step's tracked tensors), as measured on the real-size runs of
#: ``benchmarks/bench_real_size.py`` (the C allocator keeps freed blocks; RSS also counts pages of the read weights).
ALLOCATOR_SLACK = 1.10
#: With glibc keeping what is freed (``KeepFreedMemory``, a Hugging Face run's default), its heaps also keep the
#: step's freed blocks where they cannot be reused whole: the peak RSS over the tensors' peak was x1.22 (52M full
#: fine-tuning), x1.86 (52M LoRA) and x1.51-1.76 (0.5B-1B LoRA) on XA (2026-12-01, ``bench_plan_accuracy.py`` and
#: tests/run/test_fit_check.py), varying from run to run (the same 1B command: 15.39-15.91 GiB). Not predicted:
#: :attr:`RSSEstimate.kept_peak` bounds it at this factor (above the largest measured); the peak and the fit check
#: leave it out (the callback hands it back when memory runs short).
KEEP_SLACK = 2.0
#: Probe sizes: layers, vocabularies and window lengths of the small copies (micro-batch 1).
PROBE_LAYERS = (1, 2)
PROBE_VOCABS = (512, 1024)
PROBE_TOKENS = (64, 128)


@dataclass(frozen=True)
class ScaledProbe:
    """Tracked peak bytes of one training step as ``const + per_token * tokens``, each of them linear in the number
    of layers and the vocabulary: ``c0 + cl * layers + cv * vocab``."""

    const: tuple[float, float, float]
    per_token: tuple[float, float, float]
    forward_per_token: tuple[float, float, float] = (0.0, 0.0, 0.0)
    forward_const: tuple[float, float, float] = (0.0, 0.0, 0.0)
    backward_extra: tuple[float, float, float] = (0.0, 0.0, 0.0)  # step peak - forward peak, at the longest window

    @staticmethod
    def _at(fit: tuple[float, float, float], layers: int, vocab: int) -> float:
        return fit[0] + fit[1] * layers + fit[2] * vocab

    def step_bytes(self, layers: int, vocab: int, tokens: int) -> int:
        """Peak bytes the step allocates (weights and optimizer state not included).

        A step's peak is a maximum over time: at short windows it is where the gradients of a large embedding add
        up (flat in tokens), at long ones where the forward's saved tensors and the logits are (linear in tokens).
        The larger of the two fits: the step's own line, and the forward's line plus what backward added on top of
        the forward's peak at the longest probe window."""
        flat = max(self._at(self.const, layers, vocab), 0.0) + max(self._at(self.per_token, layers, vocab), 0.0) \
            * tokens
        return int(max(flat, self.forward_bytes(layers, vocab, tokens)
                       + max(self._at(self.backward_extra, layers, vocab), 0.0)))

    def forward_bytes(self, layers: int, vocab: int, tokens: int) -> int:
        """Peak bytes of the forward alone (saved tensors, logits, loss)."""
        return int(max(self._at(self.forward_const, layers, vocab), 0.0)
                   + max(self._at(self.forward_per_token, layers, vocab), 0.0) * tokens)


def _plane(points: dict[tuple[int, int], float]) -> tuple[float, float, float]:
    """``c0 + cl * layers + cv * vocab`` through the three probe points (layers, vocab)."""
    (l0, l1), (v0, v1) = PROBE_LAYERS, PROBE_VOCABS
    base = points[(l0, v0)]
    cl = (points[(l1, v0)] - base) / (l1 - l0)
    cv = (points[(l0, v1)] - base) / (v1 - v0)
    return base - cl * l0 - cv * v0, cl, cv


def probe_scaled(build: Callable[[int, int], nn.Module], step: Callable[[nn.Module, torch.Tensor], torch.Tensor],
                 autocast: contextlib.AbstractContextManager | Callable[[], contextlib.AbstractContextManager] =
                 contextlib.nullcontext, tokens: tuple[int, int] = PROBE_TOKENS,
                 vocab: int | None = None, skip_matmuls: bool = True) -> ScaledProbe:
    """Measure one training step of ``build(layers, vocab)`` on windows of ``tokens`` tokens (two lengths; a model
    with fewer positions than :data:`PROBE_TOKENS` gets shorter ones).

    With ``vocab`` (the real vocabulary) the copies have it, and only the layer count varies: a step's peak is a
    maximum over time, not a sum, and at a small vocabulary the logits are not where the peak is, so a slope measured
    between two small vocabularies misses them (on a 52M Qwen2 with 32,000 tokens it predicted 326 MiB for a step
    that took 874). The real vocabulary costs the copies its embedding (and the chunked loss its real chunking).

    Args:
        build: Returns the small model prepared as the run prepares it (adapters, base dtype, chunked loss,
            checkpointing), in train mode.
        step: ``(model, token ids (1, T)) -> loss``.
        autocast: A context (factory) the forward runs in (the run's precision).
        skip_matmuls: Matrix products return zeros of their shape instead of computing
            (:class:`~lit_speed.memory.memory_tracker.SkipMatmuls`): the same bytes, measured without the FLOPs (at
            Qwen2.5-0.5B dims the probe's time was mostly the LM head's products at the real vocabulary).
    """
    const: dict[tuple[int, int], float] = {}
    slope: dict[tuple[int, int], float] = {}
    forward: dict[tuple[int, int], float] = {}
    forward_const: dict[tuple[int, int], float] = {}
    extra: dict[tuple[int, int], float] = {}
    points = ((PROBE_LAYERS[0], PROBE_VOCABS[0]), (PROBE_LAYERS[1], PROBE_VOCABS[0]),
              (PROBE_LAYERS[0], PROBE_VOCABS[1])) if vocab is None else \
        ((PROBE_LAYERS[0], vocab), (PROBE_LAYERS[1], vocab))
    for layers, size in points:
        model = build(layers, size)
        peaks, forward_peaks = [], []
        for length in tokens:
            ids = torch.randint(0, size, (1, length), generator=torch.Generator().manual_seed(length))
            model.zero_grad(set_to_none=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with LiveTensorTracker() as tracker, SkipMatmuls() if skip_matmuls else contextlib.nullcontext():
                    with (autocast() if callable(autocast) else autocast):
                        loss = step(model, ids)
                    forward_peaks.append(tracker.peak_bytes)
                    loss.backward()
            peaks.append(tracker.peak_bytes)
        model.zero_grad(set_to_none=True)
        span = tokens[1] - tokens[0]
        slope[(layers, size)] = (peaks[1] - peaks[0]) / span
        const[(layers, size)] = peaks[0] - slope[(layers, size)] * tokens[0]
        forward[(layers, size)] = (forward_peaks[1] - forward_peaks[0]) / span
        forward_const[(layers, size)] = forward_peaks[0] - forward[(layers, size)] * tokens[0]
        extra[(layers, size)] = peaks[1] - forward_peaks[1]
        del model
    if len(points) == 2:  # the real vocabulary: linear in layers, the vocabulary's share inside the constant
        return ScaledProbe(*(_line(fit, points) for fit in (const, slope, forward, forward_const, extra)))
    return ScaledProbe(*(_plane(fit) for fit in (const, slope, forward, forward_const, extra)))


def _line(values: dict[tuple[int, int], float], points: tuple[tuple[int, int], ...]) -> tuple[float, float, float]:
    """``c0 + cl * layers`` through two points at one vocabulary (``cv = 0``: the vocabulary is the real one)."""
    (l0, v), (l1, _) = points
    cl = (values[(l1, v)] - values[(l0, v)]) / (l1 - l0)
    return values[(l0, v)] - cl * l0, cl, 0.0


@dataclass(frozen=True)
class RSSEstimate:
    """Predicted peak RSS of a training process, by part (bytes)."""

    process: int         # RSS before the model exists
    weights: int         # parameters as held (a bf16 base: 2 bytes each)
    optimizer: int       # optimizer state
    step: int            # the peak of one step's own tensors (activations, logits, gradients made in backward;
                         # or the forward beside the previous step's gradients, which Lightning frees after it)
    optimizer_step: int  # gradients + the temporaries of one optimizer step (at the step, activations are gone)
    load: int            # the model while it is read from disk (read pages + converted tensors)
    slack: float = ALLOCATOR_SLACK
    export: int = 0      # after fit: the float32 tensors of the merged export alive at once (0 without one)
    notes: tuple[str, ...] = field(default=())
    check: int = 0       # the RSS the estimate's own probe reached (it runs in the process before the weights load)
    keeps_freed: bool = False  # glibc keeps freed memory (KeepFreedMemory): see kept_peak

    @property
    def tensors(self) -> int:
        """The training step's tensors at their peak: weights, optimizer state, and the step's own or the optimizer
        step's (no process, no allocator slack; what a GPU holds of the step)."""
        return self.weights + self.optimizer + max(self.step, self.optimizer_step)

    @property
    def training_peak(self) -> int:
        return int(self.process + self.tensors * self.slack)

    @property
    def export_peak(self) -> int:
        """While the merged model is written: the weights and optimizer state still held, plus the export's own."""
        return int(self.process + (self.weights + self.optimizer + self.export) * self.slack) if self.export else 0

    @property
    def peak(self) -> int:
        return max(self.training_peak, int(self.process + self.load), self.export_peak, self.check)

    @property
    def kept_peak(self) -> int:
        """An upper bound of the peak RSS where glibc keeps freed memory (:data:`KEEP_SLACK`), else :attr:`peak`."""
        return max(self.peak, int(self.process + self.tensors * KEEP_SLACK)) if self.keeps_freed else self.peak

    def parts(self) -> dict[str, int]:
        return {"process": self.process, "weights": self.weights, "optimizer": self.optimizer, "step": self.step,
                "optimizer_step": self.optimizer_step, "load": self.load, "export": self.export, "check": self.check,
                "peak": self.peak, "kept_peak": self.kept_peak}


class PeakRSS:
    """The largest RSS of this process while the ``with`` block runs, read from ``/proc/self/statm`` by a thread
    every ``interval_s`` (``peak`` bytes; 0 where there is no such file). Linux keeps a high-water mark too, but only
    resetting it (``clear_refs``) would make it the block's, and that would hide an earlier peak from every later
    reader of the process's peak (``/usr/bin/time``, the run summary)."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s, self.peak = interval_s, 0
        self._stop: Any = None

    def _sample(self) -> None:
        self.peak = max(self.peak, int(os.pread(self._fd, 64, 0).split()[1]) * self._page)

    def _read(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> "PeakRSS":
        import threading

        try:
            self._fd = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            self._fd = None
            return self
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._sample()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is None:
            return
        self._stop.set()
        self._thread.join()
        self._sample()
        os.close(self._fd)


def predict_peak_rss(*, process: int, frozen_params: int, frozen_bytes: float, trainable_params: int,
                     trainable_bytes: float, state_bytes_per_param: float, step_temp_per_param: float,
                     probe: ScaledProbe, layers: int, vocab: int, tokens: int, load_bytes: int,
                     export_bytes: int = 0, notes: Sequence[str] = (), step_extra: int = 0,
                     check: int = 0, keeps_freed: bool = False) -> RSSEstimate:
    """Add up the parts (see the module docstring).

    Args:
        process: RSS of the process before the model is built.
        frozen_params, frozen_bytes: Frozen parameters and bytes per element as held (2 for a bf16 base).
        trainable_params, trainable_bytes: Trainable parameters and their bytes per element (4 for float32).
        state_bytes_per_param: The optimizer's state per trainable parameter (its declaration).
        step_temp_per_param: Bytes one optimizer step allocates per trainable parameter (foreach kernels copy).
        probe: The scaled probe of one step of this architecture, prepared as the run prepares it.
        layers, vocab, tokens: The real model's layers, vocabulary and tokens per micro-batch.
        load_bytes: Peak bytes while the weights are read (see :func:`load_peak_bytes`).
        export_bytes: Bytes the merged export holds at once after fit, on top of the weights (0: no export).
        step_extra: Bytes the run's step holds beyond the probe's at the same tokens (larger loss chunks).
        check: The RSS the probe itself reached (:class:`PeakRSS`): the run's peak is at least that.
        keeps_freed: glibc keeps freed memory in the run (:attr:`RSSEstimate.kept_peak`).
    """
    weights = int(frozen_params * frozen_bytes + trainable_params * trainable_bytes)
    optimizer = int(trainable_params * state_bytes_per_param)
    grads = int(trainable_params * trainable_bytes)
    # Lightning runs training_step before zero_grad (its closure: step, zero_grad, backward), so from the second
    # step on the previous step's gradients are alive through the forward (so are a window's under accumulation).
    # 50M Qwen2 full fine-tuning, Z3: the forward of step 1 peaked 1.16 GiB above weights + states, step 0's 0.82
    step = max(probe.step_bytes(layers, vocab, tokens), grads + probe.forward_bytes(layers, vocab, tokens)) \
        + int(step_extra)
    return RSSEstimate(process=int(process), weights=weights, optimizer=optimizer, step=step,
                       optimizer_step=int(grads + trainable_params * step_temp_per_param), load=int(load_bytes),
                       export=int(export_bytes), notes=tuple(notes), check=int(check), keeps_freed=keeps_freed)


def load_peak_bytes(file_bytes: int, params: int, load_dtype_bytes: int, file_dtype_bytes: int) -> int:
    """Bytes alive while ``from_pretrained`` reads a safetensors file: the tensors in the dtype they load in, plus the
    file's pages while they are mapped when the dtype changes on the way (bf16 on disk read as float32)."""
    tensors = params * load_dtype_bytes
    return int(tensors + (file_bytes if load_dtype_bytes != file_dtype_bytes else 0))




def gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


__all__ = ["ALLOCATOR_SLACK", "RSSEstimate", "ScaledProbe", "load_peak_bytes",
           "predict_peak_rss", "probe_scaled"]
