"""What :class:`~lit_speed.precision.guarded_precision.GuardedPrecision` reports, split from its training logic:
the ``precision/*`` telemetry, its checkpoint state (and what a resume restores), the start-up rows, the end-of-run
summary and the words of its non-finite messages. A mixin: the attributes it reads are GuardedPrecision's."""
from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lit_speed.precision import modes
from lit_speed.precision.nonfinite import first_nonfinite


class GuardReport:
    """Telemetry, state, description and messages of :class:`GuardedPrecision` (mixed in before ``Precision``)."""

    def _what_was_nonfinite(self, loss: Any, optimizer: Any, flags: list[bool]) -> str:
        parts = [] if flags[0] else [f"loss={float(loss) if isinstance(loss, Tensor) else loss}"]
        if not flags[1]:
            named = ((self._param_names.get(id(p), "?"), p.grad) for p in self.main_params(optimizer)
                     if p.grad is not None)
            parts.append(f"gradient of {first_nonfinite(named)}")
        return ", ".join(parts) or "non-finite on another rank"

    def _raise_message(self, step: int, what: str, scale: float | None) -> str:
        scale_txt = "" if scale is None else f", loss scale {scale:g} (min_scale {self.scaler_config['min_scale']:g})"
        if self.on_nonfinite == "fallback":
            return (f"GuardedPrecision: step {step} is still non-finite ({what}) after falling back to "
                    f"{self.mode}{scale_txt}: this is not a precision problem. Try a lower learning rate, "
                    f"gradient clipping (Trainer(gradient_clip_val=1.0)), or check the data and the loss.")
        return (f"GuardedPrecision: non-finite values at step {step} under {self.mode} ({what}{scale_txt}); "
                f"on_nonfinite='raise' stops here. Try on_nonfinite=fallback (continue in "
                f"{' -> '.join(self._chain) or modes.BASELINE}), a lower learning rate, gradient clipping "
                f"(Trainer(gradient_clip_val=1.0)), or fp32_modules=[LayerNorm] for the layers that overflow.")

    def metrics(self) -> dict[str, float]:
        """The ``precision/*`` telemetry: mode code (see ``modes.MODE_CODES``), scale, skipped steps, rate."""
        return {"precision/mode": float(modes.MODE_CODES[self.mode]),
                "precision/loss_scale": float(self.scaler.get_scale()) if self.scaler is not None else 1.0,
                "precision/skipped_steps": float(self.counters.skipped_steps),
                "precision/nonfinite_rate": self.counters.nonfinite_rate}

    def _log(self, trainer: "pl.Trainer", force: bool) -> None:
        if trainer.loggers and (force or (trainer.global_step + 1) % max(trainer.log_every_n_steps, 1) == 0):
            metrics = self.metrics()
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def state_dict(self) -> dict[str, Any]:
        state = {"mode": self.mode, "start_mode": self._start_mode or self.mode, "reason": self.reason,
                 "chain": list(self._chain), **self.counters.state_dict(), **self.threads.state_dict(),
                 **self.attention.state_dict()}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        start = state_dict.get("start_mode")
        configured = modes.AUTO if self.requested_mode == modes.AUTO else self._start_mode or self.requested_mode
        if start is not None and configured not in (modes.AUTO, start):
            rank_zero_warn(f"GuardedPrecision: the checkpoint was trained from precision {start!r} "
                           f"(last {state_dict.get('mode')!r}); this run asks for {configured!r}, so the "
                           f"checkpoint's precision state is not restored.")
            return
        self.threads.load_state_dict(state_dict)
        self.attention.load_state_dict(state_dict)
        reused = self.requested_mode == modes.AUTO and state_dict.get("mode") is not None
        self._timing_candidates = None  # auto's decision comes from the checkpoint: the resumed run is not re-timed
        self._switch_to(state_dict.get("mode", self.mode))
        self._start_mode = start or self.mode
        self._chain = list(state_dict.get("chain", self._chain))
        self.counters.load_state_dict(state_dict)
        self._resolved = True
        if self.counters.fallbacks:
            self.reason = f"restored from checkpoint: fell back from {self.counters.fallbacks[-1]['from']}"
        elif reused:
            self.reason = f"precision=auto's decision, restored from the checkpoint (not timed again): " \
                          f"{state_dict.get('reason', 'no reason saved')}"
        if not self._spec.loss_scaling:
            self.scaler = None
        elif "scaler" in state_dict:
            self._pending_scaler_state = state_dict["scaler"]
            if self.device_type is not None:
                self._make_scaler()
        why = f"{self.reason}; " if reused or self.counters.fallbacks else ""
        rank_zero_info(f"GuardedPrecision: resumed in {self.mode} ({why}{self.counters.skipped_steps} skipped steps)")

    def describe(self) -> dict[str, str]:
        """Rows for the start-up table (before setup, ``auto`` shows the probe's guess and what setup will time)."""
        shown = None
        if self.requested_mode == modes.AUTO and not self._resolved:
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
            self.mode, self.reason = self._resolve(device_type, probe=True)
            if device_type == "cpu" and self.mode != modes.BASELINE:  # timed on the first training batch, CPU only
                shown = (f"auto: times {', '.join(modes.TIMED_CANDIDATES)} on this model's first training batch and "
                         f"keeps the fastest (by rule alone: {self.mode}, {self.reason})")
        scaler = ", ".join(f"{k}={v:g}" for k, v in self.scaler_config.items())
        guard = self.on_nonfinite + (f" after {self.fallback_after} bad steps -> "
                                     f"{' -> '.join(self._chain or modes.default_chain(self.mode)) or 'none'}"
                                     if self.on_nonfinite == "fallback" else "")
        rows = {"precision": shown or (f"{self.mode} ({self.reason})" if self.requested_mode == modes.AUTO
                                       else self.mode),
                "non-finite guard": guard}
        if self._spec.loss_scaling:
            rows["loss scaler"] = scaler
        if self.threads.requested is not None:
            rows["threads"] = self.threads.describe()
        if self.attention.requested is not None:
            rows["attention"] = self.attention.describe()
        if self.fp32_modules:
            rows["fp32 modules"] = ", ".join(getattr(m, "__name__", str(m)) for m in self.fp32_modules)
        return rows

    def final_summary(self) -> dict[str, Any]:
        """End-of-run numbers merged into ``summary.json``."""
        return {"mode": self.mode, "requested": self.requested_mode, "reason": self.reason,
                "attempted_steps": self.counters.attempted_steps, "skipped_steps": self.counters.skipped_steps,
                "nonfinite_rate": self.counters.nonfinite_rate, "fallbacks": list(self.counters.fallbacks),
                "loss_scale": self.metrics()["precision/loss_scale"], "threads": torch.get_num_threads(),
                "threads_reason": self.threads.reason, "attention": self.attention.chosen,
                "attention_reason": self.attention.reason}
