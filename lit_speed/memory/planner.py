"""Will it fit? Measure a model's activation memory once, then rank precision x checkpointing x micro-batch x
ZeRO configurations by predicted peak memory and speed, each with the Hydra overrides that run it.

"Peak" everywhere in this module means: the most bytes of tensor storage alive at once during one training
step (forward, backward and optimizer step) on the training device, counted by
:class:`~lit_speed.memory.memory_tracker.LiveTensorTracker` -- what ``torch.cuda.max_memory_allocated``
reports on a GPU, minus allocator caching and kernel workspaces. Process RSS adds the Python/torch runtime
(~370 MB here) and allocator slack on top of it.

How a row is predicted: for each precision and checkpointing choice the real module runs forward+backward at
two probe micro-batches under the tracker; activation bytes are fitted as ``a + b * micro_batch`` and the
step time as ``t0 + t1 * micro_batch``. One optimizer step is measured the same way for its temporaries.
Model-state bytes come from :func:`~lit_speed.memory.model_state.model_state_bytes`. On a CPU the probes run on the
CPU: activation bytes are the same on a GPU for the same dtypes, speeds are not (re-run there).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import shlex
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch import nn

import lit_speed  # the public names: the optimizer's declared state (lit_speed.state_bytes_per_param)
from lit_speed.compat.torch import tree_map
from lit_speed.memory.activation_checkpointing import checkpoint_modules, restore_modules
from lit_speed.memory.memory_tracker import LiveTensorTracker, tensor_bytes
from lit_speed.memory.model_state import STRATEGIES, model_state_bytes, parameter_counts
from lit_speed.precision.modes import BASELINE, PLAN_CANDIDATES, TABLE, autocast_context, spec

# Assumed (not measured here) per-process speed factors of DeepSpeed options relative to plain training.
STRATEGY_SPEED = {"auto": 1.0, "ddp": 1.0, "zero1": 1.0, "zero2": 0.95, "zero2_offload": 0.7, "zero3": 0.8,
                  "zero3_offload": 0.5}
MULTI_PROCESS_EFFICIENCY = 0.9  # assumed data-parallel scaling efficiency per extra process


@dataclass(frozen=True)
class PlanRow:
    """One candidate configuration and its prediction."""

    precision: str
    checkpointing: bool
    micro_batch: int
    strategy: str
    world_size: int
    peak_bytes: int         # predicted device peak per process
    host_bytes: int         # offloaded model state per process (host RAM)
    activation_bytes: int   # of peak_bytes: activations + gradients produced during backward
    samples_per_sec: float  # predicted, all processes together
    relative_speed: float = 1.0
    fits: bool = True
    overrides: tuple[str, ...] = ()

    @property
    def command(self) -> str:
        return "python scripts/train.py " + shlex.join(self.overrides)


@dataclass
class Plan:
    """The ranked rows (fitting ones first, fastest first) and what they were measured on."""

    rows: list[PlanRow]
    budget_bytes: int | None
    notes: list[str] = field(default_factory=list)

    @property
    def fitting(self) -> list[PlanRow]:
        return [r for r in self.rows if r.fits]

    def table_rows(self, limit: int | None = None) -> list[list[str]]:
        out = []
        for r in (self.fitting if self.budget_bytes else self.rows)[:limit]:
            out.append([r.precision, "yes" if r.checkpointing else "no", str(r.micro_batch),
                        r.strategy + (f" x{r.world_size}" if r.world_size > 1 else ""),
                        f"{r.peak_bytes / 2**20:,.1f}", f"{r.host_bytes / 2**20:,.1f}",
                        f"{r.relative_speed:.2f}", shlex.join(r.overrides)])
        return out


def resize_batch(batch: Any, micro_batch: int) -> Any:
    """Every tensor of ``batch`` cut or tiled along dim 0 to ``micro_batch`` rows."""
    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        reps = -(-micro_batch // t.shape[0])
        return t.repeat(reps, *([1] * (t.dim() - 1)))[:micro_batch].clone()
    return tree_map(one, batch)


def default_step(model: nn.Module, batch: Any) -> torch.Tensor:
    """A LightningModule's ``training_step`` loss; for a plain module, the mean of its output."""
    step = getattr(model, "training_step", None)
    if step is None:
        return model(batch).float().mean()
    out = step(batch, 0)
    return out["loss"] if isinstance(out, dict) else out


def _precision_context(precision: str, device_type: str) -> contextlib.AbstractContextManager:
    """Autocast as the mode runs it (GuardedPrecision: 16-mixed is fp16 autocast on CPU too)."""
    return autocast_context(device_type, spec(precision).autocast_dtype)


def _linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    slope = (ys[-1] - ys[0]) / (xs[-1] - xs[0])
    return ys[0] - slope * xs[0], slope


@dataclass(frozen=True)
class Probe:
    """Peak bytes (forward alone, forward+backward) and seconds per step, each ``intercept + slope * micro_batch``."""

    bytes_fit: tuple[float, float]
    seconds_fit: tuple[float, float]
    forward_fit: tuple[float, float] = (0.0, 0.0)

    def activation_bytes(self, micro_batch: int) -> int:
        return int(self.bytes_fit[0] + self.bytes_fit[1] * micro_batch)

    def forward_bytes(self, micro_batch: int) -> int:
        return int(self.forward_fit[0] + self.forward_fit[1] * micro_batch)

    def samples_per_sec(self, micro_batch: int) -> float:
        t0, t1 = self.seconds_fit
        if t0 < 0 or t1 <= 0:  # timing noise swamped the fit: fall back to constant time per sample
            t0, t1 = 0.0, max(t0 + t1 * 2, 1e-9) / 2
        return micro_batch / (t0 + t1 * micro_batch)


def probe(model: nn.Module, batch: Any, precision: str = BASELINE, checkpoint: Sequence[str | type] = (),
          micro_batches: tuple[int, int] = (2, 4), step_fn: Callable[[nn.Module, Any], torch.Tensor] = default_step,
          repeats: int = 2) -> Probe:
    """Measure forward+backward peak bytes (params excluded) and time at two micro-batches.

    ``checkpoint`` names the submodule types to checkpoint during the probe (restored afterwards).
    """
    module_dtype = spec(precision).module_dtype  # raises for an unknown precision
    device_type = next(model.parameters()).device.type
    if module_dtype is not None:  # bf16-true, bf16-master: the module trains in bf16
        model = copy.deepcopy(model).to(module_dtype)
    was_training = model.training
    model.train()
    if checkpoint:
        checkpoint_modules(model, checkpoint)
    peaks, forward_peaks, seconds = [], [], []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # self.log() outside a Trainer
            for b in micro_batches:
                sized = resize_batch(batch, b)
                times = []
                for i in range(repeats + 1):
                    model.zero_grad(set_to_none=True)
                    tracker = LiveTensorTracker(device_type) if i == 0 else contextlib.nullcontext()
                    t0 = time.perf_counter()
                    with tracker, _precision_context(precision, device_type):
                        loss = step_fn(model, sized)
                    if i == 0:
                        forward_peaks.append(tracker.peak_bytes)
                    with tracker:
                        loss.backward()
                    if i == 0:
                        peaks.append(tracker.peak_bytes)
                    else:  # untracked repeats: the tracker itself slows every op
                        times.append(time.perf_counter() - t0)
                seconds.append(min(times))  # the least-disturbed repeat: the machine is shared
    finally:
        model.zero_grad(set_to_none=True)
        if checkpoint:
            restore_modules(model)
        model.train(was_training)
    return Probe(_linear_fit(micro_batches, peaks), _linear_fit(micro_batches, seconds),
                 _linear_fit(micro_batches, forward_peaks))


class OptimizerProbe(NamedTuple):
    """One optimizer step measured on copies of the parameters."""

    step_bytes: int  # temporaries of one step, on top of parameters, gradients and state
    state_bytes: Callable[[torch.dtype], float]  # bytes of state per parameter held in a dtype
    name: str        # the optimizer's class
    source: str      # "declared" (asked) or "counted after one step"


def measure_optimizer(model: nn.Module, optimizer_factory: Callable[..., torch.optim.Optimizer]) -> OptimizerProbe:
    """Build the optimizer on copies of the trainable parameters (named, for optimizers that split by name) and step
    it: the temporary bytes one step allocates on top of parameters, gradients and state, the bytes of state it keeps
    per parameter for a parameter dtype (its own declaration, :func:`lit_speed.state_bytes_per_param`, else whole
    tensors counted after the step), and where that came from."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    copies = [p.detach().clone().requires_grad_(True) for _, p in named]
    for c in copies:
        c.grad = torch.zeros_like(c)
    wants_names = getattr(getattr(optimizer_factory, "func", optimizer_factory), "wants_param_names", False)
    optimizer = optimizer_factory([{"params": copies, "param_names": [n for n, _ in named]}] if wants_names
                                  else copies)
    optimizer.step()  # creates the state outside the tracker
    declared_temporaries = getattr(optimizer, "step_temporary_bytes", None)
    if callable(declared_temporaries):  # a step torch.compile builds cannot run under the tracker's dispatch mode
        step_bytes, how = int(declared_temporaries()), "; step temporaries declared, not traced"
    else:
        with LiveTensorTracker() as tracker:
            optimizer.step()
        step_bytes, how = tracker.peak_bytes, ""
    name = type(optimizer).__name__
    if lit_speed.state_bytes_per_param(optimizer) is not None:
        return OptimizerProbe(step_bytes, functools.partial(lit_speed.state_bytes_per_param, optimizer), name,
                              "declared" + how)
    counted = sum(t.numel() for state in optimizer.state.values() for t in state.values()
                  if isinstance(t, torch.Tensor) and t.dim() > 0)
    tensors = counted / max(sum(c.numel() for c in copies), 1)
    return OptimizerProbe(step_bytes, lambda dtype: tensors * dtype.itemsize, name, "counted after one step" + how)


def _overrides(precision: str, checkpointing: bool, micro_batch: int, strategy: str, world_size: int,
               modules: Sequence[str], base: Sequence[str], batch_key: str, callbacks: Sequence[str]
               ) -> tuple[str, ...]:
    out = [*base, f"precision={precision}", f"{batch_key}={micro_batch}"]
    if checkpointing:
        out += [f"callbacks=[{','.join([*callbacks, 'activation_checkpointing'])}]",
                f"callbacks.activation_checkpointing.modules=[{','.join(modules)}]"]
    if strategy != "auto":
        out.append(f"strategy={strategy}")
    if world_size > 1:
        out.append(f"trainer.devices={world_size}")
    return tuple(out)


def plan(model: nn.Module, batch: Any, budget_bytes: int | None = None, micro_batches: Sequence[int] = (4, 8, 16, 32),
         precisions: Sequence[str] = PLAN_CANDIDATES, checkpoint_modules: Sequence[str] = ("Block",),
         strategies: Sequence[str] = ("auto",), world_size: int = 1,
         optimizer_factory: Callable[..., torch.optim.Optimizer] | None = None, base_overrides: Sequence[str] = (),
         batch_key: str = "data.batch_size", probe_batches: tuple[int, int] = (2, 4),
         step_fn: Callable[[nn.Module, Any], torch.Tensor] = default_step,
         callbacks: Sequence[str] = ("default",)) -> Plan:
    """Rank training configurations of ``model`` by predicted peak memory and speed.

    Args:
        model: The real module (a LightningModule: its ``training_step`` gives the loss).
        batch: One training batch; it is cut or tiled to each micro-batch size.
        budget_bytes: Device memory per process; rows above it are marked as not fitting.
        micro_batches: Candidate micro-batch sizes.
        precisions: Candidate Lightning precision literals.
        checkpoint_modules: Submodule types to checkpoint in the "checkpointing" rows; empty = never checkpoint.
        strategies: Options of ``conf/strategy`` to consider.
        world_size: Processes (ZeRO partitions state over them).
        optimizer_factory: ``params -> Optimizer`` the run trains with (default AdamW foreach): built once on copies,
            it is asked its state per parameter and one step's temporaries are measured.
        base_overrides: Overrides every row starts with (e.g. ``experiment=charlm_cpu``).
        batch_key: Config key of the micro-batch size.
        probe_batches: The two micro-batch sizes that are measured.
        step_fn: ``(model, batch) -> loss``.
        callbacks: The ``callbacks`` options a checkpointing row keeps (it adds ``activation_checkpointing``).

    Raises:
        ValueError: An unknown strategy or precision, an optimizer factory that is not callable, empty candidate
            lists, or probe sizes not increasing.

    Example::

        plan(model, next(iter(dm.train_dataloader())), budget_bytes=64 * 2**20).rows[0].command
    """
    _check_plan_arguments(strategies, precisions, optimizer_factory, micro_batches, probe_batches)
    counts = parameter_counts(model)
    n_params, n_frozen = counts.trainable, counts.frozen  # frozen: a base under adapters
    measured = measure_optimizer(model, optimizer_factory or (lambda ps: torch.optim.AdamW(ps, foreach=True)))
    ckpt_choices = (False, True) if checkpoint_modules else (False,)
    probes = {(p, c): probe(model, batch, p, checkpoint_modules if c else (), probe_batches, step_fn)
              for p in precisions for c in ckpt_choices}
    rows = []
    for (precision, ckpt), pr in probes.items():
        for mb in micro_batches:
            for strategy in strategies:
                peak, host, act, speed = _predict(pr, measured, batch, precision, mb, strategy, world_size, n_params,
                                                  n_frozen)
                rows.append(PlanRow(precision, ckpt, mb, strategy, world_size, peak, host, act, speed,
                                    fits=budget_bytes is None or peak <= budget_bytes,
                                    overrides=_overrides(precision, ckpt, mb, strategy, world_size,
                                                         [str(m) for m in checkpoint_modules], base_overrides,
                                                         batch_key, callbacks)))
    fastest = max(r.samples_per_sec for r in rows)
    rows = [PlanRow(**{**r.__dict__, "relative_speed": r.samples_per_sec / fastest}) for r in rows]
    rows.sort(key=lambda r: (not r.fits, -r.relative_speed, -r.micro_batch))
    return Plan(rows, budget_bytes, _notes(model, n_params, n_frozen, probe_batches, measured))


def _check_plan_arguments(strategies: Sequence[str], precisions: Sequence[str], optimizer_factory: Any,
                          micro_batches: Sequence[int], probe_batches: tuple[int, int]) -> None:
    for name, values, allowed in (("strategies", strategies, STRATEGIES), ("precisions", precisions, TABLE)):
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise ValueError(f"plan {name} must be a non-empty list from {sorted(allowed)}, got {list(values)}")
    if optimizer_factory is not None and not callable(optimizer_factory):
        raise ValueError(f"optimizer_factory must be a callable params -> Optimizer (e.g. the optimizer group's "
                         f"_partial_), or None for AdamW; got {optimizer_factory!r}")
    if not micro_batches or min(micro_batches) < 1:
        raise ValueError(f"micro_batches must be a non-empty list of sizes >= 1, got {list(micro_batches)}")
    if len(probe_batches) != 2 or not 1 <= probe_batches[0] < probe_batches[1]:
        raise ValueError(f"probe_batches must be two increasing sizes >= 1, got {probe_batches}")


def _predict(pr: Any, measured: Any, batch: Any, precision: str, mb: int, strategy: str, world_size: int,
             n_params: int, n_frozen: int) -> tuple[int, int, int, float]:
    """One row's peak device bytes, host bytes, activation bytes and samples/s, from a probe of its precision and
    checkpointing and the strategy's state layout."""
    layout = STRATEGIES[strategy]
    st = model_state_bytes(n_params, precision, layout=layout, world_size=world_size, frozen_params=n_frozen,
                           state_bytes=measured.state_bytes)
    width = spec(precision).param_bytes
    # the probe's activations include full gradients; ZeRO-2/3 keep only their partition
    act = pr.activation_bytes(mb) - width * n_params + st.grads
    temp = 0 if layout.offload_optimizer else measured.step_bytes * width // 4 // (world_size if layout.stage else 1)
    # Lightning zero-grads after training_step, so last step's gradients live through the forward
    forward = pr.forward_bytes(mb) + st.grads
    resident = st.device - st.grads  # parameters and optimizer state left on the device
    peak = resident + max(forward, act, st.grads + temp) + tensor_bytes(resize_batch(batch, mb))
    speed = pr.samples_per_sec(mb) * STRATEGY_SPEED[strategy]
    speed *= world_size * (MULTI_PROCESS_EFFICIENCY if world_size > 1 else 1.0)
    return peak, st.host, act, speed


def _notes(model: nn.Module, n_params: int, n_frozen: int, probe_batches: tuple[int, int], measured: Any) -> list[str]:
    counted = f"{n_params:,} trainable + {n_frozen:,} frozen parameters" if n_frozen else f"{n_params:,} parameters"
    device = next(model.parameters()).device.type
    notes = [f"{counted}; probes at micro-batch {probe_batches[0]} and {probe_batches[1]} on {device}",
             "peak = most tensor bytes alive in one training step (like torch.cuda.max_memory_allocated)",
             "speed is measured for precision x checkpointing x micro-batch; ZeRO/multi-process factors are assumed",
             f"optimizer: {measured.name} keeps {measured.state_bytes(torch.float32):.2f} bytes of state per float32 "
             f"parameter ({measured.source})"]
    if device == "cpu":
        notes.append("measured on CPU: activation bytes carry over to a GPU for the same dtypes, speeds do not "
                     "(re-run the planner there)")
    return notes
