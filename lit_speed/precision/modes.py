"""The precision-mode table, and the rules of GuardedPrecision's modes: validation, ``auto``, fallback chains.

One :class:`ModeSpec` per mode (Lightning's literals, and lit_speed's ``bf16-master``) says what the mode does to a
model's numbers: the dtype of the module's weights, the dtype autocast runs matmuls in, whether float32 master
weights are kept, whether the loss is scaled, and what DeepSpeed runs it as. Everything that needs one of those facts
asks :func:`spec` (the plugin, the planner's probes, the model-state calculator in
:mod:`lit_speed.memory.model_state`, FLOPs/MFU's compute dtype, ZeRO's precision section) instead of writing the
literal again; ``tests/test_architecture.py`` counts the files that still do. A new mode is one row here.

Nothing here needs a ``Trainer``; :class:`~lit_speed.precision.guarded_precision.GuardedPrecision` wires the rules to
Lightning's hooks, and the tests exercise every rule with given inputs (device, bf16 support, probe ratio).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch


@dataclass(frozen=True)
class ModeSpec:
    """What one precision mode does to a model's numbers.

    Args:
        name: The literal (``"bf16-mixed"``).
        weight_dtype: The dtype of the module's parameters, and so of their gradients, while training.
        autocast_dtype: The dtype autocast runs matmuls in, ``None`` for no autocast.
        master_weights: The optimizer steps float32 copies of the weights (and keeps its state in float32).
        loss_scaling: Gradients underflow without a dynamic loss scale (fp16).
        deepspeed_as: The Lightning literal ``ZeroStrategy`` hands DeepSpeed for this mode (DeepSpeed's ``bf16``
            section is ``bf16-master``: a bf16 module with float32 masters), ``None`` where ZeRO cannot run it.
        guarded: ``GuardedPrecision`` runs it (the others are Lightning-only literals a logger may still meet).
        one_process: Runs on a single process only (its gradient hook would move gradients before DDP all-reduces).
        code: The value ``precision/mode`` logs (loggers take numbers).
    """

    name: str
    weight_dtype: torch.dtype
    autocast_dtype: torch.dtype | None = None
    master_weights: bool = False
    loss_scaling: bool = False
    deepspeed_as: str | None = None
    guarded: bool = True
    one_process: bool = False
    code: int | None = None

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the heavy ops (matmuls) run in: what a matmul probe and MFU's peak must use."""
        return self.autocast_dtype or self.weight_dtype

    @property
    def param_bytes(self) -> int:
        """Bytes per parameter element (and per gradient element) of the module."""
        return self.weight_dtype.itemsize

    @property
    def float32_weights(self) -> bool:
        """Float32 weights exist (the module's, or the masters): a fallback to another mode loses nothing."""
        return self.weight_dtype == torch.float32 or self.master_weights

    @property
    def module_dtype(self) -> torch.dtype | None:
        """The dtype the plugin casts the whole module (and its float inputs) to, ``None`` when it stays float32.
        ``bf16-master``'s module is cast by its :class:`~lit_speed.precision.master_weights.MasterWeights`."""
        return None if self.weight_dtype == torch.float32 else self.weight_dtype

    @property
    def optimizer_dtype(self) -> torch.dtype:
        """The dtype a torch optimizer keeps its state in: the masters' float32, else the weights' dtype."""
        return torch.float32 if self.master_weights else self.weight_dtype


#: Every mode lit_speed reasons about, in the order errors list them.
TABLE: dict[str, ModeSpec] = {s.name: s for s in (
    ModeSpec("32-true", torch.float32, deepspeed_as="32-true", code=0),
    ModeSpec("bf16-mixed", torch.float32, torch.bfloat16, deepspeed_as="bf16-mixed", code=1),
    ModeSpec("16-mixed", torch.float32, torch.float16, loss_scaling=True, deepspeed_as="16-mixed", code=2),
    ModeSpec("bf16-true", torch.bfloat16, deepspeed_as="bf16-true", code=3),
    ModeSpec("bf16-master", torch.bfloat16, master_weights=True, deepspeed_as="bf16-mixed", one_process=True, code=4),
    ModeSpec("16-true", torch.float16, deepspeed_as="16-true", guarded=False),
    ModeSpec("64-true", torch.float64, guarded=False),
    # Lightning's TransformerEnginePrecision: fp8 matmuls around bf16/fp16 weights (MFU's peak: the weights' dtype)
    ModeSpec("transformer-engine", torch.bfloat16, guarded=False),
    ModeSpec("transformer-engine-float16", torch.float16, guarded=False),
)}
AUTO = "auto"  # not a mode: GuardedPrecision picks one at setup
#: The full-precision mode: the end of every fallback chain and the reference the others are timed against.
BASELINE = "32-true"
#: Modes a user may ask GuardedPrecision for.
MODES = (*(name for name, s in TABLE.items() if s.guarded), AUTO)
#: Modes a fallback chain may move to, in order: mixed modes keep float32 weights, so switching between them is free.
CHAIN_MODES = ("16-mixed", "bf16-mixed", BASELINE)
#: ``precision/mode`` is logged as a number (loggers take floats); the code of each mode.
MODE_CODES = {name: s.code for name, s in TABLE.items() if s.code is not None}
#: Modes ``auto`` times on the user's own step (CPU with native bf16); the fastest finite one is chosen.
TIMED_CANDIDATES = (BASELINE, "bf16-master", "bf16-mixed")
#: The modes a memory plan compares when none are named: full precision and bf16 without loss scaling.
PLAN_CANDIDATES = (BASELINE, "bf16-mixed")
#: The modes DeepSpeed runs under ZeroStrategy (as Lightning literals).
DEEPSPEED_MODES = tuple(name for name, s in TABLE.items() if s.deepspeed_as == name)
NONFINITE_POLICIES = ("skip", "fallback", "raise")
DEVICE_TYPES = ("cpu", "cuda")


def spec(mode: str) -> ModeSpec:
    """The :class:`ModeSpec` of ``mode``.

    Raises:
        ValueError: For a literal the table does not hold, listing the ones it does.
    """
    found = TABLE.get(str(mode))
    if found is None:
        raise ValueError(f"precision must be one of {', '.join(TABLE)}, got {mode!r}")
    return found


def compute_dtype(mode: str) -> torch.dtype:
    """The dtype the heavy ops run in under ``mode``; float32 for a literal the table does not know."""
    found = TABLE.get(str(mode))
    return found.compute_dtype if found is not None else torch.float32


def autocast_dtype(mode: str) -> torch.dtype | None:
    """The dtype autocast runs matmuls in for ``mode`` (``None``: no autocast)."""
    return spec(mode).autocast_dtype


def autocast_context(device_type: str, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """The autocast a lit_speed forward runs in for ``dtype`` (``None``: none): ``cache_enabled=False``, as
    Lightning's own precision plugins run it. With the cache, autocast keeps the low-precision copy of every weight
    it casts until the forward ends (Qwen2.5-0.5B dims, full fine-tuning: the forward's tensors 1.56 GiB against 0.89), so a
    probe or a timing that ran with it measured a forward the run does not have."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype, cache_enabled=False)


def check_mode(mode: Any) -> str:
    """Return ``mode`` if it is a known mode, else raise a ``ValueError`` that lists the choices."""
    if mode not in MODES:
        raise ValueError(f"GuardedPrecision(mode={mode!r}): mode must be one of {', '.join(MODES)}; got {mode!r}. "
                         f"Fix: pick one, e.g. GuardedPrecision(mode='bf16-mixed').")
    return str(mode)


def choose_auto_mode(device_type: str, cuda_bf16: bool, cpu_bf16: bool, cpu_slowdown: float | None,
                     max_slowdown: float) -> tuple[str, str]:
    """The fastest numerically safe mode for a device, and the reason (shown in the start-up table).

    Args:
        device_type: ``"cuda"`` or ``"cpu"``.
        cuda_bf16: ``torch.cuda.is_bf16_supported()`` on the device in use.
        cpu_bf16: the CPU has native bf16 kernels (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``).
        cpu_slowdown: measured bf16/fp32 matmul time ratio on this CPU (``None``: not measured).
        max_slowdown: above this ratio a CPU bf16 mode is refused.
    """
    if device_type == "cuda":
        if cuda_bf16:
            return "bf16-mixed", "CUDA device supports bf16: same range as fp32, no loss scaling needed"
        return "16-mixed", "CUDA device without bf16: fp16 with dynamic loss scaling"
    if not cpu_bf16:
        return "32-true", "CPU without native bf16 kernels: bf16/fp16 matmuls are emulated and much slower"
    if cpu_slowdown is not None and cpu_slowdown > max_slowdown:
        return "32-true", f"CPU bf16 matmul measured {cpu_slowdown:.1f}x slower than fp32 (> {max_slowdown:g}x)"
    measured = "" if cpu_slowdown is None else f" (bf16 matmul {cpu_slowdown:.2f}x the fp32 time)"
    return "bf16-mixed", f"CPU with native bf16 kernels{measured}"


def check_device_support(mode: str, device_type: str, cuda_bf16: bool) -> None:
    """Refuse a mode the device cannot run, naming the setting and the fix."""
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"GuardedPrecision runs on {' or '.join(DEVICE_TYPES)}; the trainer's device is "
                         f"{device_type!r}. Fix: Trainer(accelerator='cpu' or 'gpu'), or use Lightning's own "
                         f"precision plugin for {device_type}.")
    if device_type == "cuda" and compute_dtype(mode) == torch.bfloat16 and not cuda_bf16:
        raise ValueError(f"GuardedPrecision(mode={mode!r}): mode={mode!r} needs bf16 support, which this CUDA "
                         f"device lacks "
                         f"(torch.cuda.is_bf16_supported() is False; bf16 needs Ampere or newer). "
                         f"Fix: mode='16-mixed' (fp16 with loss scaling) or mode='auto'.")


def default_chain(mode: str, bf16_ok: bool = True) -> list[str]:
    """Modes tried after ``mode`` fails: 16-mixed -> bf16-mixed -> 32-true (bf16 dropped if unsupported)."""
    if mode in TABLE and spec(mode).master_weights:
        return [BASELINE]  # the float32 masters become the module's weights
    if mode not in CHAIN_MODES:
        return []
    rest = list(CHAIN_MODES[CHAIN_MODES.index(mode) + 1:])
    return [m for m in rest if bf16_ok or m != "bf16-mixed"]


def check_chain(mode: str, chain: Sequence[str] | None, on_nonfinite: str) -> list[str] | None:
    """Validate a user's fallback chain (``None`` = the default chain, resolved once the device is known)."""
    if on_nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"GuardedPrecision(on_nonfinite={on_nonfinite!r}): on_nonfinite must be one of "
                         f"{', '.join(NONFINITE_POLICIES)}; got {on_nonfinite!r}. Fix: on_nonfinite='fallback' to "
                         "switch mode after repeated bad steps.")
    if on_nonfinite == "fallback" and mode in TABLE and not spec(mode).float32_weights:
        raise ValueError("GuardedPrecision(on_nonfinite='fallback'): on_nonfinite='fallback' needs a mixed mode "
                         "(float32 weights to fall back to); bf16-true keeps the weights in bf16. Fix: "
                         "on_nonfinite='skip' or 'raise' with mode='bf16-true', or mode='bf16-mixed'.")
    if chain is None:
        return None
    chain = list(chain)
    bad = [m for m in chain if m not in CHAIN_MODES]
    if bad or len(set(chain)) != len(chain) or mode in chain:
        raise ValueError(f"GuardedPrecision(fallback_chain={chain!r}): fallback_chain must list distinct modes from "
                         f"{', '.join(CHAIN_MODES)}, without the starting mode {mode!r}; got {chain}. Fix: e.g. "
                         "fallback_chain=['32-true'].")
    return chain


def allowed_modes(candidates: Sequence[str], strategy: Any) -> list[str]:
    """The ``candidates`` :func:`check_strategy` accepts under ``strategy`` (all of them when it is ``None``)."""
    if strategy is None:
        return list(candidates)
    allowed = []
    for mode in candidates:
        try:
            check_strategy(mode, strategy)
        except ValueError:
            continue
        allowed.append(mode)
    return allowed


#: strategies whose processes all-reduce gradients torch's way: a one-process mode (bf16-master) cannot run under
#: them, nor on several processes of any strategy but DeepSpeed's (which keeps float32 masters itself)
MULTI_PROCESS_STRATEGIES = ("DDPStrategy", "FSDPStrategy", "ModelParallelStrategy", "XLAStrategy")


def refused_processes(mode: str, strategy_classes: Iterable[str], processes: int | None) -> bool:
    """The one rule for a one-process mode: whether ``mode`` cannot run under a strategy of these class names
    (its class hierarchy's) on ``processes`` processes (``None``: not known yet). Asked by ``GuardedPrecision`` at
    set-up and by the runner's config check before any process starts."""
    names = set(strategy_classes)
    if mode not in TABLE or not spec(mode).one_process or "DeepSpeedStrategy" in names:
        return False
    return bool(names & set(MULTI_PROCESS_STRATEGIES)) or (processes is not None and processes > 1)


def check_strategy(mode: str, strategy: Any) -> None:
    """Refuse strategies that scale the loss themselves or need a sharded scaler (never a double scaler).

    DeepSpeed owns loss scaling and the backward/step calls: a DeepSpeed strategy must take precision over
    (``lit_speed.ZeroStrategy`` builds DeepSpeed's bf16/fp16 sections from this plugin and replaces it), so
    reaching this plugin's setup under DeepSpeed means nobody did.
    """
    from lit_speed import strategy_facts

    facts = strategy_facts(strategy)
    if facts.deepspeed:
        raise ValueError(
            f"GuardedPrecision(mode={mode!r}) is installed under {type(strategy).__name__}, which did not take "
            "precision over: DeepSpeed runs its own loss scaler, backward and step, so this plugin would "
            "double-scale or bypass it. Fix: lit_speed.ZeroStrategy(stage=1|2|3) (it configures "
            "DeepSpeed's bf16/fp16 from this plugin), or drop the plugin and pass Trainer(precision=...).")
    if refused_processes(mode, facts.names, None):
        raise ValueError(
            f"GuardedPrecision(mode='bf16-master'): mode='bf16-master' runs on one process for now: its gradient "
            f"hook moves each bf16 gradient into the float32 master before {type(strategy).__name__} could all-reduce "
            f"it. Fix: mode='bf16-mixed' (float32 weights, autocast) for multi-process runs, or a single-device "
            f"strategy.")
    if mode in TABLE and spec(mode).loss_scaling and facts.is_a("FSDPStrategy", "ModelParallelStrategy", "XLAStrategy"):
        raise ValueError(
            f"GuardedPrecision(mode='16-mixed'): mode='16-mixed' needs loss scaling, which GuardedPrecision cannot "
            f"do under "
            f"{type(strategy).__name__} (sharded gradients need that strategy's own scaler). Fix: "
            f"mode='bf16-mixed' (no scaler needed), or Trainer(precision='16-mixed') without this plugin.")
