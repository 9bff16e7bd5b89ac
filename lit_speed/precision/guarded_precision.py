"""``GuardedPrecision``: mixed precision that stays finite, shows its work, and falls back safely."""
from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lit_speed.compat import lightning as pl_compat
from lit_speed.precision import modes
from lit_speed.precision.attention_choice import AttentionChoice
from lit_speed.precision.fp32_modules import Float32Islands, cast_floating, default_dtype, match_modules
from lit_speed.precision.guard_report import GuardReport
from lit_speed.precision.master_weights import MasterWeights
from lit_speed.precision.nonfinite import Action, GuardCounters, all_finite, decide, is_genuine
from lit_speed.precision.probe import DEFAULT_MAX_SLOWDOWN, cpu_has_native_bf16, measure_slowdown, slowdown_warning
from lit_speed.precision.skip_aware_scheduler import SkipAwareScheduler
from lit_speed.precision.step_timing import auto_mode_for
from lit_speed.precision.thread_choice import ThreadChoice
from lit_speed.tuning import on_rank_zero

_WARNED_SLOW: set[torch.dtype] = set()  # the slowness warning is shown once per process and dtype


def _cuda_bf16() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


class GuardedPrecision(GuardReport, Precision):
    """Mixed precision (CPU and CUDA) with a non-finite guard, fallback chain, telemetry and resumable state.

    Args:
        mode: ``32-true`` | ``bf16-mixed`` | ``16-mixed`` | ``bf16-true`` | ``bf16-master`` | ``auto`` (the
            fastest safe mode on the trainer's device, chosen at setup; the reason is shown by :meth:`describe`).
        on_nonfinite: What a genuine inf/NaN step does (it never reaches the weights): ``skip`` it,
            ``fallback`` to the next mode after ``fallback_after`` consecutive ones, or ``raise``.
            ``None`` = ``fallback``, or ``skip`` for ``bf16-true`` (its weights are bf16: nothing to fall back to).
        fallback_after: Consecutive genuine non-finite steps that trigger a fallback.
        fallback_chain: Modes to fall back to, in order; ``None`` = 16-mixed -> bf16-mixed -> 32-true from
            ``mode`` on (bf16 skipped where the device lacks it).
        init_scale, growth_factor, backoff_factor, growth_interval: ``torch.amp.GradScaler`` settings (16-mixed).
        min_scale: The loss scale never backs off below this; an overflow at ``min_scale`` counts as genuine.
        matmul_precision: ``highest`` | ``high`` | ``medium`` (TF32 on Ampere+) for float32 matmuls, or ``None``.
        fp32_modules: Classes, class names or module names kept in float32 under autocast.
        max_cpu_slowdown: Warn when a CPU low-precision matmul probes slower than this ratio to fp32.
        threads: Intra-op threads: ``None`` (torch's), an int, or ``"auto"``: timed at 1..cores threads on the run's
            first optimizer steps (copies of the step first in a deterministic, multi-process or GPU run; see
            :mod:`.thread_choice`).
        attention: ``scaled_dot_product_attention``'s kernel: ``None`` (torch's), ``math``, ``flash``, ... or
            ``"auto"``: torch's pick and math timed on the first batch, in the mode in use (:mod:`.attention_choice`).

    Raises:
        ValueError: An unknown mode or policy, a bad scaler setting, or (at setup) a device or strategy that
            cannot run the mode. Each message names the setting and the fix.

    Example::

        trainer = Trainer(plugins=[GuardedPrecision("16-mixed", on_nonfinite="fallback")])
    """

    def __init__(self, mode: str = modes.BASELINE, on_nonfinite: str | None = None, fallback_after: int = 3,
                 fallback_chain: Sequence[str] | None = None, init_scale: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int = 2000,
                 min_scale: float = 1.0, matmul_precision: str | None = None,
                 fp32_modules: Sequence[str | type] = (), max_cpu_slowdown: float = DEFAULT_MAX_SLOWDOWN,
                 threads: int | str | None = None, attention: str | None = None) -> None:
        self.requested_mode = modes.check_mode(mode)
        self.threads = ThreadChoice(threads)
        self.attention = AttentionChoice(attention)
        if on_nonfinite is None:  # nothing to fall back to without float32 weights
            on_nonfinite = "fallback" if mode == modes.AUTO or modes.spec(mode).float32_weights else "skip"
        self._user_chain = modes.check_chain(mode, fallback_chain, on_nonfinite)
        if not (isinstance(fallback_after, int) and fallback_after >= 1):
            raise ValueError(f"GuardedPrecision(fallback_after={fallback_after!r}): fallback_after must be an int "
                             f">= 1, got {fallback_after!r}")
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1
                and 0 < min_scale <= init_scale):
            raise ValueError("GuardedPrecision: the scaler settings need init_scale > 0, growth_factor > 1, 0 < "
                             "backoff_factor < 1, growth_interval >= 1 and 0 < min_scale <= init_scale; got "
                             f"init_scale={init_scale}, growth_factor={growth_factor}, backoff_factor="
                             f"{backoff_factor}, growth_interval={growth_interval}, min_scale={min_scale}")
        if matmul_precision not in (None, "highest", "high", "medium"):
            raise ValueError(f"GuardedPrecision(matmul_precision={matmul_precision!r}): matmul_precision must be "
                             f"'highest', 'high', 'medium' or None; got "
                             f"{matmul_precision!r}")
        self.on_nonfinite = on_nonfinite
        self.fallback_after = fallback_after
        self.scaler_config = {"init_scale": float(init_scale), "growth_factor": float(growth_factor),
                              "backoff_factor": float(backoff_factor), "growth_interval": int(growth_interval),
                              "min_scale": float(min_scale)}
        self.matmul_precision = matmul_precision
        self.fp32_modules = list(fp32_modules)
        self.max_cpu_slowdown = float(max_cpu_slowdown)
        guess = "cuda" if torch.cuda.is_available() else "cpu"
        self.device_type: str | None = None  # set at setup from the trainer's root device
        self.mode, self.reason = self._resolve(guess, probe=False)
        self.scaler: torch.amp.GradScaler | None = None
        self._scaler_device: str | None = None
        self._start_mode: str | None = None  # the resolved mode this run started in (saved in checkpoints)
        self.counters = GuardCounters()
        self.last_step_skipped = False  # read by the LR-scheduler wrapper and by accumulation callbacks
        self._chain: list[str] = []
        self._resolved = False
        self._pending_scaler_state: dict[str, Any] | None = None
        self._loss_finite: Tensor | None = None
        self._param_names: dict[int, str] = {}
        self._islands: Float32Islands | None = None
        self._previous_matmul_precision: str | None = None
        self._master: MasterWeights | None = None  # bf16-master: the float32 masters of the module
        self._optimizers: list[Optimizer] = []
        self._module: nn.Module | None = None  # the module this plugin converted (for a switch of mode)
        self._trainer: "pl.Trainer | None" = None
        # precision=auto on a CPU with native bf16: the modes to time on the first training batch (None: decided)
        self._timing_candidates: list[str] | None = None

    @property
    def precision(self) -> str:  # type: ignore[override]
        """The Lightning literal of the current mode (changes after a fallback)."""
        return self.mode

    @property
    def _spec(self) -> modes.ModeSpec:
        """What the current mode does (:mod:`lit_speed.precision.modes`)."""
        return modes.spec(self.mode)

    @property
    def _cast_dtype(self) -> torch.dtype | None:
        """The dtype this plugin casts the module to itself (``bf16-true``); ``bf16-master``'s masters cast theirs."""
        return None if self._spec.master_weights else self._spec.module_dtype

    # ---- setup -------------------------------------------------------------------------------------------

    def _resolve(self, device_type: str, probe: bool, strategy: Any = None) -> tuple[str, str]:
        """The mode by rule (device, bf16 support, the matmul probe); ``auto`` may still time it (:meth:`_setup`)."""
        if self.requested_mode != modes.AUTO:
            return self.requested_mode, "requested"
        cpu_probe = probe and device_type == "cpu" and cpu_has_native_bf16()
        return modes.choose_auto_mode(device_type, _cuda_bf16(), cpu_has_native_bf16(), measure_slowdown(
            torch.bfloat16) if cpu_probe else None, self.max_cpu_slowdown)

    def _timed_candidates(self, rule_mode: str, strategy: Any) -> list[str] | None:
        """The modes ``auto`` times on the first training batch: on a CPU with native bf16 kernels, when the rule
        did not already rule bf16 out, among the modes the strategy accepts (no ``bf16-master`` under DDP)."""
        if self.requested_mode != modes.AUTO or self.device_type != "cpu" or rule_mode == modes.BASELINE \
                or not cpu_has_native_bf16():
            return None
        candidates = modes.allowed_modes(modes.TIMED_CANDIDATES, strategy)
        return candidates if len(candidates) > 1 else None

    def _setup(self, module: nn.Module) -> None:
        """Resolve the device and mode, check the combination, build the scaler (idempotent)."""
        trainer = _trainer_of(module)
        if trainer is not None:
            self.device_type = trainer.strategy.root_device.type
            modes.check_strategy(self.mode, trainer.strategy)
        else:
            self.device_type = next((p.device.type for p in module.parameters()), "cpu")
        if trainer is not None:
            self._trainer = trainer
        if not self._resolved:
            strategy = trainer.strategy if trainer is not None else None

            def resolve() -> tuple[str, str]:
                return self._resolve(self.device_type, probe=True, strategy=strategy)

            # rank 0 decides for every process
            self.mode, self.reason = on_rank_zero(resolve, trainer) if trainer is not None else resolve()
            self._timing_candidates = self._timed_candidates(self.mode, strategy) if trainer is not None else None
            if self._timing_candidates is not None:  # the baseline until the first training batch has been timed
                self.mode = modes.BASELINE
                self.reason = (f"{self.reason}; times {', '.join(self._timing_candidates)} on this model's step at "
                               "the first training batch and keeps the fastest")
            self._set_chain()
            self._start_mode = self.mode
            self._resolved = True
            if self.requested_mode == modes.AUTO and self._timing_candidates is None:
                rank_zero_info(f"GuardedPrecision: precision=auto -> {self.mode} ({self.reason})")
        modes.check_device_support(self.mode, self.device_type, _cuda_bf16())
        self.attention.check_device(self.device_type)
        if self.device_type == "cpu" and self.requested_mode != modes.AUTO:
            self._warn_if_slow(modes.compute_dtype(self.mode))
        if self._spec.loss_scaling and (self.scaler is None or self._scaler_device != self.device_type):
            self._make_scaler()
        self.threads.apply_fixed()
        if self.matmul_precision is not None and self._previous_matmul_precision is None:
            self._previous_matmul_precision = torch.get_float32_matmul_precision()
            torch.set_float32_matmul_precision(self.matmul_precision)

    def _warn_if_slow(self, dtype: torch.dtype) -> None:
        if dtype == torch.float32 or dtype in _WARNED_SLOW:
            return
        message = slowdown_warning(dtype, measure_slowdown(dtype), self.max_cpu_slowdown)
        if message:
            _WARNED_SLOW.add(dtype)
            rank_zero_warn(message, category=UserWarning)

    def _make_scaler(self) -> None:
        cfg = {k: v for k, v in self.scaler_config.items() if k != "min_scale"}
        self._scaler_device = self.device_type or "cpu"
        self.scaler = torch.amp.GradScaler(self._scaler_device, **cfg)
        if self._pending_scaler_state is not None:
            self.scaler.load_state_dict(self._pending_scaler_state)
            self._pending_scaler_state = None

    def _set_chain(self) -> None:
        bf16_ok = _cuda_bf16() if self.device_type == "cuda" else cpu_has_native_bf16()
        self._chain = list(self._user_chain) if self._user_chain is not None else \
            modes.default_chain(self.mode, bf16_ok)

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        self._module = module
        self._setup(module)
        if self._spec.master_weights and (self._master is None or self._master.module is not module):
            self._master = MasterWeights(module)  # masters from the (restored) float32 weights, module -> bf16
        return module.to(self._cast_dtype) if self._cast_dtype is not None else module

    @override
    def connect(self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
                ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        self._setup(model)
        self._param_names = {id(p): n for n, p in model.named_parameters()}
        self._optimizers = list(optimizers)
        if self._master is not None:  # the optimizers step the float32 masters; the guard names them
            self._param_names.update(self._master.attach(optimizers))
        if self.fp32_modules:
            self._islands = Float32Islands(self.device_type or "cpu", self._cast_dtype)
            self._islands.install(match_modules(model, self.fp32_modules))
        for config in lr_schedulers:  # no scheduler step on a skipped optimizer step (Lightning #18828)
            if not isinstance(config.scheduler, SkipAwareScheduler):
                config.scheduler = SkipAwareScheduler(config.scheduler, lambda: self.last_step_skipped)
        return model, optimizers, lr_schedulers

    @override
    def teardown(self) -> None:
        self.threads.finish()  # a run that ended during threads=auto's trial: decided from the steps it timed
        if self._islands is not None:
            self._islands.remove()
        if self._previous_matmul_precision is not None:
            torch.set_float32_matmul_precision(self._previous_matmul_precision)
            self._previous_matmul_precision = None

    # ---- forward -----------------------------------------------------------------------------------------

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        dtype = self._spec.autocast_dtype
        device_type = self.device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        if dtype is not None:
            context = modes.autocast_context(device_type, dtype)
        elif self._cast_dtype is not None:
            context = default_dtype(self._cast_dtype)
        else:
            context = nullcontext()
        with context, self.attention.context():
            yield

    @override
    def convert_input(self, data: Any) -> Any:
        # the training loop hands every batch here before its transfer: threads=auto, then precision=auto, then
        # attention=auto decide at the first one
        training = self._trainer is not None and self._trainer.training and not self._trainer.sanity_checking
        if training and self.threads.pending:
            self.threads.decide(self._trainer, data, self.mode)
        if self._timing_candidates is not None and training:
            self._decide_by_timing(data)
        if training and self.attention.pending:  # in the mode just chosen
            self.attention.decide(self._trainer, data, self.mode)
        if training and self.threads.watching:  # threads=auto timed on the run's own steps
            self.threads.on_batch(self._trainer.global_step)
        module_dtype = self._spec.module_dtype  # a bf16 module (bf16-true, bf16-master) takes bf16 inputs
        return cast_floating(data, module_dtype) if module_dtype is not None else data

    def _decide_by_timing(self, batch: Any) -> None:
        """``auto`` on a CPU with native bf16: time the candidate modes on copies of the model with this (the
        first) training batch, keep the fastest, and switch to it before the batch is trained on. Rank 0 times
        for every process. Nothing of the run is touched: the model is copied, no batch is drawn, and the RNG
        states training sees are restored (:func:`~lit_speed.precision.step_timing.auto_mode_for`). With
        ``attention=auto``, each mode is timed with its faster kernel (its calls timed first): the pair is decided."""
        trainer, candidates = self._trainer, self._timing_candidates
        assert trainer is not None and candidates is not None
        self._timing_candidates = None

        def time_modes() -> tuple[str, str]:
            module, device = trainer.lightning_module, trainer.strategy.root_device
            timed = self.attention.with_modes(module, batch, candidates, device)
            decided = auto_mode_for(module, batch, timed, device)
            if decided is None or decided[0] not in timed:
                rule = self.reason.split("; times ", 1)[0]
                return (self._resolve(self.device_type or "cpu", probe=True)[0],
                        f"{rule}; {decided[1] if decided else 'could not time this model on its batch'}")
            joint = bool(self.attention.per_mode) and "+" not in decided[0]  # timed per mode: torch's won in it
            return (f"{decided[0]}+default" if joint else decided[0], decided[1] + self.attention.per_mode_line())

        chosen, self.reason = on_rank_zero(time_modes, trainer)
        self._switch_to(self.attention.take_joint(chosen, self.reason))
        self._start_mode = self.mode
        rank_zero_info(f"GuardedPrecision: precision=auto -> {self.mode} ({self.reason})")

    def _switch_to(self, mode: str) -> None:
        """Move a set-up run to ``mode`` before its first step (auto's decision, or the one a checkpoint holds):
        the mixed modes only change the autocast; ``bf16-master`` makes the module bf16 and points the optimizers
        at float32 masters (no optimizer state exists yet, or it is loaded after this)."""
        if mode == self.mode:
            return
        self.mode = mode
        if self._spec.master_weights and self._master is None and self._module is not None:
            self._master = MasterWeights(self._module)
            self._param_names.update(self._master.attach(self._optimizers))
        self._release_masters()
        self._set_chain()
        if self._spec.loss_scaling and self.scaler is None:
            self._make_scaler()

    # ---- backward and step -------------------------------------------------------------------------------

    @override
    def pre_backward(self, tensor: Tensor, module: "pl.LightningModule") -> Tensor:  # type: ignore[override]
        finite = torch.isfinite(tensor.detach()).all()  # no sync: read together with the gradients
        self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    @override
    def optimizer_step(self, optimizer: Any, model: "pl.LightningModule", closure: Callable[[], Any],  # type: ignore[override]
                       **kwargs: Any) -> Any:
        if isinstance(optimizer, LBFGS):
            raise ValueError("GuardedPrecision checks gradients between backward and step, but LBFGS re-runs "
                             "the closure inside step(). Fix: use Lightning's default precision for LBFGS.")
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            self._loss_finite = None  # training_step returned None: no backward, nothing to step
            return closure_result
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)  # clipping and hooks see true gradients; the step below too
        # on_before_optimizer_step hooks, then clipping on the unscaled gradients (Lightning's private
        # Precision._after_closure, through lit_speed.compat and pinned by tests/compat/test_compat.py)
        pl_compat.run_before_step_hooks_and_clipping(self, model, optimizer)
        grads = [p.grad for p in self.main_params(optimizer) if p.grad is not None]
        loss_finite = self._loss_finite if self._loss_finite is not None else torch.tensor(True)
        flags = torch.stack([loss_finite, all_finite(grads).to(loss_finite.device)]).tolist()  # the one host sync
        self._loss_finite = None
        trainer = model.trainer
        bad = self._any_rank(trainer, not all(flags))
        scale = self.scaler.get_scale() if self.scaler is not None else None
        genuine = bad and self._any_rank(trainer, is_genuine(flags[0], flags[1], scale,
                                                             self.scaler_config["min_scale"]))
        action = decide(self.counters, bad, genuine, self.on_nonfinite, self.fallback_after, bool(self._chain))
        self.last_step_skipped = action is not Action.STEP
        if action is Action.STEP:
            optimizer.step(**kwargs)
            if self._master is not None:
                self._master.copy_to_model()
        if self.scaler is not None:
            self.scaler.update()
            if self.scaler.get_scale() < self.scaler_config["min_scale"]:
                self.scaler.update(new_scale=self.scaler_config["min_scale"])
        if action in (Action.RAISE, Action.FALLBACK):
            what = self._what_was_nonfinite(closure_result, optimizer, flags)
            if action is Action.RAISE:
                raise FloatingPointError(self._raise_message(trainer.global_step, what, scale))
            self._fall_back(trainer.global_step, what)
        self._log(trainer, force=action is Action.FALLBACK)
        return closure_result

    def _any_rank(self, trainer: "pl.Trainer", flag: bool) -> bool:
        """Every rank takes the same decision (a NaN on one rank must skip the step everywhere)."""
        return trainer.strategy.reduce_boolean_decision(flag, all=False) if trainer.world_size > 1 else flag

    def _fall_back(self, step: int, what: str) -> None:
        old, self.mode = self.mode, self._chain.pop(0)
        self._release_masters()
        self.reason = f"fell back from {old} at step {step}"
        self.counters.consecutive_bad = 0
        self.counters.fallbacks.append({"step": step, "from": old, "to": self.mode, "reason": what})
        if self._spec.loss_scaling:
            self._make_scaler()
        else:
            self.scaler = None
        rank_zero_warn(f"GuardedPrecision: {self.fallback_after} consecutive non-finite steps under {old} (last "
                       f"at step {step}: {what}); continuing in {self.mode}. The checkpoint keeps this mode.")

    def _release_masters(self) -> None:  # left bf16-master: the float32 masters become the weights
        if self._master is not None and not self._spec.master_weights:
            self._master.release(self._optimizers)
            self._master = None


def _trainer_of(module: nn.Module) -> "pl.Trainer | None":
    """The Trainer ``module`` is attached to; ``None`` outside fit/validate or for a plain ``nn.Module``."""
    return pl_compat.attached_trainer(module) if isinstance(module, pl.LightningModule) else None
