"""Gradient accumulation scheduled by optimizer step, epoch, samples or tokens, with token-correct normalisation."""
from __future__ import annotations

from typing import Any, Mapping, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lit_speed import strategy_facts
from lit_speed.accumulation import micro_batch as mb
from lit_speed.accumulation.schedule import (
    LR_SCALINGS,
    RAMPS,
    UNITS,
    check_choice,
    check_divisible,
    checked_argument,
    factor_at,
    factor_for_effective_batch,
    lr_scale,
    schedule_plan,
    validate_schedule,
    value_at,
)
from lit_speed.accumulation.window import (
    NORMALIZE,
    batch_samples,
    optimizer_parameters,
    partial_gradients,
    restore_partial_gradients,
    scale_gradients,
    window_scale,
)
from lit_speed.accumulation.window_runs import WindowRuns
from lit_speed.compat import lightning as pl_compat
from lit_speed.interfaces import AccumulationFollower
from lit_speed.step_logging import log_step_metrics


class AccumulationScheduler(WindowRuns, Callback):
    """Accumulate gradients over a number of micro-batches that follows a schedule, normalised per item.

    The factor is chosen at the start of every accumulation window from the position reached (optimizer
    steps, epochs, samples or tokens seen), so it changes exactly at the scheduled step. The gradient
    applied is ``grad(sum of per-item losses over the window) / items in the window`` (items summed over
    processes), also for the ragged last window of an epoch. Module contract: ``training_step`` returns the
    mean loss over its micro-batch's items, as usual; the items are counted from the batch (see
    :mod:`lit_speed.accumulation.window`). ``normalize="micro_batch"`` keeps Lightning's classic mean of
    micro-batch means (still correct for a ragged window).

    Args:
        factors: ``{position: micro-batches per optimizer step}``, keys strictly increasing from 0.
        effective_batch: ``{position: samples per optimizer step over all processes}``; give this *or* factors.
        unit: What the keys count: ``"step"`` (optimizer steps), ``"epoch"``, ``"samples"`` or ``"tokens"``.
        ramp: ``"step"`` (hold each value until the next key) or ``"linear"`` (interpolate, rounded down to
            whole micro-batches).
        micro_batch: Samples per micro-batch; ``None`` keeps the datamodule's, an int sets
            ``datamodule.batch_size``, ``"auto"`` picks the largest that fits ``memory_budget_mb``.
        normalize: ``"samples"``, ``"tokens"`` (targets != ``ignore_index``), ``"micro_batch"``, or ``"auto"``: what
            the DataModule's ``loss_items`` names (``"tokens"`` for :class:`~lit_speed.sft.SFTDataModule`, whose
            examples train on different numbers of response tokens), else ``"samples"``.
        ignore_index: Target value that is padding (for ``normalize="tokens"``).
        lr_scaling: Rescale the LR with the effective batch: ``"none"``, ``"linear"`` or ``"sqrt"``.
        memory_budget_mb: Activation-memory budget for ``micro_batch="auto"``.
        oom_recovery: On an out-of-memory error, halve the micro-batch, double the accumulation and retry the
            window from its start (single process only).

    Raises:
        ValueError: On an invalid schedule or setting; at fit start, on incompatible Trainer settings.

    Example::

        scheduler = AccumulationScheduler(factors={0: 1, 200: 4, 1000: 8})
        trainer = Trainer(callbacks=[scheduler])
    """

    def __init__(self, factors: Optional[Mapping[int, int]] = None, effective_batch: Optional[Mapping[int, int]] = None,
                 unit: str = "step", ramp: str = "step", micro_batch: int | str | None = None,
                 normalize: str = "auto", ignore_index: int = -100, lr_scaling: str = "none",
                 memory_budget_mb: Optional[float] = None, oom_recovery: bool = True) -> None:
        if (factors is None) == (effective_batch is None):
            raise ValueError(f"AccumulationScheduler(factors={factors!r}): give exactly one of factors={{0: 4, ...}} "
                             f"or effective_batch={{0: 256, ...}}, got factors={factors!r}, "
                             f"effective_batch={effective_batch!r}")
        self.factors = checked_argument("factors", factors, validate_schedule) if factors is not None else None
        self.effective_batch = (checked_argument("effective_batch", effective_batch, validate_schedule)
                                if effective_batch is not None else None)
        self.unit = checked_argument("unit", unit, check_choice, UNITS)
        self.ramp = checked_argument("ramp", ramp, check_choice, RAMPS)
        self.normalize = checked_argument("normalize", normalize, check_choice, ("auto", *NORMALIZE))
        self.normalize_setting = self.normalize  # "auto" is resolved from the DataModule at setup
        self.lr_scaling = checked_argument("lr_scaling", lr_scaling, check_choice, LR_SCALINGS)
        if micro_batch is not None and micro_batch != "auto" and (not isinstance(micro_batch, int) or micro_batch < 1):
            raise ValueError(f"AccumulationScheduler(micro_batch={micro_batch!r}): micro_batch must be an int >= 1, "
                             f"'auto' or None, got {micro_batch!r}")
        if micro_batch == "auto" and (self.effective_batch is None or not memory_budget_mb or memory_budget_mb <= 0):
            raise ValueError("AccumulationScheduler(micro_batch='auto'): micro_batch='auto' needs "
                             "effective_batch={...} (the target to keep) and "
                             f"memory_budget_mb > 0, got effective_batch={effective_batch!r}, "
                             f"memory_budget_mb={memory_budget_mb!r}")
        self.micro_batch = micro_batch
        self.ignore_index = ignore_index
        self.memory_budget_mb = memory_budget_mb
        self.oom_recovery = oom_recovery
        # decisions read by Lightning's loop (patched through lit_speed.compat) and by optimizer_steps_now()
        self.step_now = False
        self.zero_now = True
        # window state (resumable)
        self._factor = self.factors[0] if self.factors else 1  # dataloader batches per window
        self._pieces = 1          # micro-batches per dataloader batch (doubles after each OOM)
        self._pos = 0             # dataloader batches done in the current window
        self._window = [0, 0, 0]  # items, samples, tokens of this process in the current window
        self._seen = [0, 0]       # samples, tokens over all processes in completed windows
        self._loader_batch: Optional[int] = None
        self._applied_lr_scale = 1.0
        self._last_items = 0.0
        self._weight = 1.0
        self._saved_grads: Optional[dict[str, torch.Tensor]] = None
        self._window_batches: list[Any] = []
        self._oom_count = 0
        self._epoch_end = False
        self._deepspeed = False
        self._follower: Optional[AccumulationFollower] = None
        self._trainer: Optional["pl.Trainer"] = None
        self._last_logged: dict[str, float] = {}

    # ------------------------------------------------------------------ what the rest of lit_speed reads
    @property
    def current_factor(self) -> int:
        """Micro-batches per optimizer step in the current window (per process)."""
        return self._factor * self._pieces

    def optimizer_steps_now(self) -> bool:
        """Whether the optimizer steps after the micro-batch now running.

        This makes the callback a :class:`~lit_speed.interfaces.AccumulationDecider`: ``ZeroStrategy`` reads it.
        """
        return self.step_now

    def accumulation_plan(self, micro_batch: int | None, world_size: int) -> tuple[int, int, str]:
        """:func:`~lit_speed.accumulation.schedule.schedule_plan` of this schedule (``run_contract.AccumulationPlan``)."""
        arg, schedule = ("factors", self.factors) if self.factors is not None else ("effective_batch", self.effective_batch)
        micro = self.micro_batch if isinstance(self.micro_batch, int) else micro_batch
        return checked_argument(arg, schedule, schedule_plan, arg == "factors", self.unit, self.ramp, micro, world_size)

    def describe(self) -> dict[str, str]:
        """Rows for the start-up table."""
        what = (f"factors {self.factors}" if self.factors is not None
                else f"effective batch {self.effective_batch} ({self.ramp} ramp)")
        per = "auto (the data's: tokens for data=sft, else samples)" if self.normalize == "auto" else self.normalize
        return {"accumulation": f"{what} by {self.unit}; normalised per {per}; "
                                f"lr scaling {self.lr_scaling}; micro-batch {self.micro_batch or 'from data'}; "
                                f"OOM recovery {'on' if self.oom_recovery else 'off'}"}

    def final_summary(self) -> dict[str, Any]:
        return {"factor": self.current_factor, "micro_batch": self._micro(), "oom_retries": self._oom_count,
                "normalize": self.normalize,
                "samples_seen": self._seen[0], "tokens_seen": self._seen[1]}

    # ------------------------------------------------------------------ set-up and refusals
    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        if not pl_module.automatic_optimization:
            raise ValueError("AccumulationScheduler needs automatic optimization, but the LightningModule sets "
                             "automatic_optimization = False; accumulate inside your training_step instead, "
                             "or remove the callback")
        if trainer.accumulate_grad_batches != 1 and self._trainer is not trainer:
            raise ValueError(f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) and "
                             "AccumulationScheduler both set accumulation; remove accumulate_grad_batches from the "
                             "Trainer (or use AccumulationScheduler(factors={0: N}))")
        self._deepspeed = strategy_facts(trainer.strategy).deepspeed
        self._follower = trainer.strategy if isinstance(trainer.strategy, AccumulationFollower) else None
        if self._deepspeed and self._follower is None:
            raise ValueError(f"AccumulationScheduler with {type(trainer.strategy).__name__}: use "
                             "lit_speed.ZeroStrategy(stage=1|2|3), which keeps DeepSpeed's "
                             "gradient_accumulation_steps and boundary in step with this callback")
        if self.oom_recovery and (trainer.world_size > 1 or self._deepspeed):
            # a retry on one rank alone would desynchronise the collectives; DeepSpeed counts micro-steps itself
            self.oom_recovery = False
            rank_zero_info("accumulation: OOM recovery is off (it needs a single process without DeepSpeed)")
        dm = trainer.datamodule
        if self.normalize_setting == "auto":
            self.normalize = getattr(dm, "loss_items", "samples") if getattr(dm, "loss_items", None) in NORMALIZE \
                else "samples"
        if isinstance(self.micro_batch, int) or self.micro_batch == "auto":
            if dm is None or not hasattr(dm, "batch_size"):
                raise ValueError(f"AccumulationScheduler(micro_batch={self.micro_batch!r}): micro_batch="
                                 f"{self.micro_batch!r} sets datamodule.batch_size, but "
                                 f"{type(dm).__name__} has none; use micro_batch=null and size the DataLoader yourself")
            if self.micro_batch == "auto":
                self.micro_batch = self._auto_micro_batch(trainer, pl_module)
            dm.batch_size = self.micro_batch
        self._trainer = trainer
        pl_compat.install_accumulation_controller(trainer, self)

    def _auto_micro_batch(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> int:
        batch = trainer.strategy.batch_to_device(next(iter(trainer.datamodule.train_dataloader())))
        chosen, per_sample = mb.probe_micro_batch(pl_module, batch, self.effective_batch, trainer.world_size,
                                                  self.memory_budget_mb)
        rank_zero_info(f"accumulation: micro_batch auto -> {chosen} ({per_sample / 2**20:.3f} MiB activations per "
                       f"sample, budget {self.memory_budget_mb} MiB)")
        return chosen

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            pl_compat.uninstall_accumulation_controller(trainer)

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._saved_grads is not None:  # resumed mid-window: put the partial window's gradients back
            restore_partial_gradients(self._saved_grads, trainer.optimizers, pl_module)
            self._saved_grads = None
        trainer.accumulate_grad_batches = self.current_factor
        self._last_logged = {}  # a new fit starts with empty callback_metrics
        if self._deepspeed:  # the engine scales the window's gradients for us: refused here if it cannot
            self._follower.scale_step_gradients(1.0)

    # ------------------------------------------------------------------ the window
    def _position(self, trainer: "pl.Trainer") -> float:
        return {"step": trainer.global_step, "epoch": trainer.current_epoch,
                "samples": self._seen[0], "tokens": self._seen[1]}[self.unit]

    def _micro(self) -> Optional[int]:
        return None if self._loader_batch is None else self._loader_batch // self._pieces

    def _start_window(self, trainer: "pl.Trainer", batch: Any) -> None:
        if self._loader_batch is None:
            self._loader_batch = batch_samples(batch)
            if isinstance(self.micro_batch, int) and self._loader_batch != self.micro_batch:
                raise ValueError(f"AccumulationScheduler(micro_batch={self.micro_batch!r}): micro_batch="
                                 f"{self.micro_batch} but the train DataLoader yields "
                                 f"batches of {self._loader_batch}; use micro_batch=null")
            if self.effective_batch is not None:  # the keys of a linear ramp too: they are what it promises
                checked_argument("effective_batch", self.effective_batch, check_divisible, self._loader_batch,
                                 trainer.world_size)
        position = self._position(trainer)
        if self.factors is not None:
            self._factor = factor_at(self.factors, position, self.ramp)
        else:
            target = value_at(self.effective_batch, position, self.ramp)
            self._factor = factor_for_effective_batch(target, self._loader_batch, trainer.world_size)
        self._apply_lr_scale(trainer)
        trainer.accumulate_grad_batches = self.current_factor

    def _one_micro_batch(self, trainer: "pl.Trainer") -> bool:
        """Whether the window is one micro-batch on one process, where normalisation changes nothing."""
        return self._factor == 1 and self._pieces == 1 and trainer.world_size == 1 and not self._deepspeed

    def _effective(self, trainer: "pl.Trainer", factor: int) -> int:
        return self._loader_batch * factor * trainer.world_size

    def _apply_lr_scale(self, trainer: "pl.Trainer") -> None:
        if self.lr_scaling == "none":
            return
        base = (self.factors[0] * self._loader_batch * trainer.world_size if self.factors is not None
                else factor_for_effective_batch(self.effective_batch[0], self._loader_batch, trainer.world_size)
                * self._loader_batch * trainer.world_size)
        scale = lr_scale(self._effective(trainer, self._factor), base, self.lr_scaling)
        ratio = scale / self._applied_lr_scale
        if ratio == 1.0:
            return
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] *= ratio
        for config in trainer.lr_scheduler_configs:  # schedulers recompute lr from base_lrs every step
            if hasattr(config.scheduler, "base_lrs"):
                config.scheduler.base_lrs = [lr * ratio for lr in config.scheduler.base_lrs]
        self._applied_lr_scale = scale

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        # decided here, before the strategy's own on_train_batch_start (ZeroStrategy reads the decision)
        if self._pos == 0:
            self._start_window(trainer, batch)
        self._epoch_end = pl_compat.is_last_batch_of_epoch(trainer)  # ends a ragged window
        self.zero_now = self._pos == 0
        self.step_now = self._pieces == 1 and (self._pos + 1 == self._factor or self._epoch_end)

    @override
    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: torch.Tensor) -> None:
        weight = self._weight
        if weight != 1.0:
            loss.register_hook(lambda grad: grad * weight)

    @override
    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Any) -> None:
        if not self.step_now:  # DeepSpeed: Lightning calls the optimizer (and this hook) on every micro-batch
            return
        if trainer.world_size > 1:
            totals = torch.tensor(self._window, dtype=torch.float64, device=pl_module.device)
            items, samples, tokens = (float(v) for v in trainer.strategy.reduce(totals, reduce_op="sum").tolist())
        else:
            items, samples, tokens = (float(v) for v in self._window)
        scale = window_scale(items, trainer.world_size)  # refuses a window without items in every case
        if self._one_micro_batch(trainer):
            pass  # the gradient of the micro-batch's mean loss is already the normalised gradient
        elif self._deepspeed:  # gradients out of reach (ZeRO's flat partitions): the strategy scales them
            self._follower.scale_step_gradients(scale)  # back to 1 after the step, before the next backward
        else:  # the optimizer's parameters: under bf16-master these are the float32 masters holding the gradients
            scale_gradients(optimizer_parameters([optimizer]), scale)
        self._last_items = items
        self._seen[0] += int(samples)
        self._seen[1] += int(tokens)

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self.step_now:
            return
        if self._deepspeed:
            self._follower.scale_step_gradients(1.0)
        # self.log costs ~0.5 ms per value on a CPU: log what changed, and everything when the loggers write
        log_step_metrics(trainer, pl_module, {
            "accumulation/factor": float(self.current_factor),
            "accumulation/micro_batch": float(self._micro()),
            "accumulation/effective_batch": float(self._effective(trainer, self._factor)),
            "accumulation/items_in_window": self._last_items,
        }, self._last_logged)

    # ------------------------------------------------------------------ resume
    @override
    def state_dict(self) -> dict[str, Any]:
        state = {"factor": self._factor, "pieces": self._pieces, "pos": self._pos, "window": list(self._window),
                 "seen": list(self._seen), "loader_batch": self._loader_batch, "step_now": self.step_now,
                 "applied_lr_scale": self._applied_lr_scale, "oom_count": self._oom_count}
        if self._pos and self._trainer is not None:  # mid-window: the partial gradients are part of the state
            if self._trainer.world_size > 1 or self._deepspeed:
                rank_zero_warn("accumulation: checkpoint taken mid-window with several processes or ZeRO; it holds "
                               "rank 0's partial gradients only, so resuming from it is not exact. Checkpoint at "
                               "window ends (ModelCheckpoint(every_n_train_steps=...) does).")
            state["partial_grads"] = partial_gradients(self._trainer.optimizers)
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._factor = state_dict.get("factor", 1)
        self._pieces = state_dict.get("pieces", 1)
        self._pos = state_dict.get("pos", 0)
        self._window = list(state_dict.get("window", [0, 0, 0]))
        self._seen = list(state_dict.get("seen", [0, 0]))
        self._loader_batch = state_dict.get("loader_batch")
        self.step_now = state_dict.get("step_now", False)
        self._applied_lr_scale = state_dict.get("applied_lr_scale", 1.0)
        self._oom_count = state_dict.get("oom_count", 0)
        self._saved_grads = state_dict.get("partial_grads")
