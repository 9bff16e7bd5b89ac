"""The one door to Lightning's private loop internals that per-step accumulation needs.

Written against Lightning 2.6.6. Lightning decides accumulation from ``batch_idx % accumulate_grad_batches``
inside the epoch, so windows must line up with multiples of a factor fixed for the whole epoch. A
factor that changes at an optimizer step, a ragged window, or a window retried after an OOM needs the
decisions made by the callback instead. Three *instance* attributes are shadowed (classes are untouched,
and :func:`uninstall` removes them):

* ``trainer.fit_loop.epoch_loop._should_accumulate()`` -> ``not controller.step_now``. It gates the
  optimizer step, DDP's ``no_sync`` on non-boundary micro-batches, LR-scheduler stepping, and the
  logger's step counter.
* ``trainer.fit_loop.epoch_loop.automatic_optimization._make_zero_grad_fn`` -> zero only when
  ``controller.zero_now`` (body copied from Lightning 2.6.6).
* ``trainer.fit_loop.epoch_loop.automatic_optimization.run`` -> ``controller.run_batch(original_run, ...)``,
  so a batch can be split into smaller micro-batches (after an OOM) and retried.

``tests/accumulation/test_lightning_internals.py`` fails loudly if these stop existing or change meaning.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

import lightning.pytorch as pl

_PATCHED = ("_should_accumulate",)
_PATCHED_OPT = ("_make_zero_grad_fn", "run")


class Controller(Protocol):
    step_now: bool
    zero_now: bool

    def run_batch(self, run: Callable[..., Any], optimizer: Any, batch_idx: int, kwargs: Any) -> Any: ...


def install(trainer: "pl.Trainer", controller: Controller) -> None:
    """Route Lightning 2.6.6's accumulation decisions for ``trainer`` to ``controller``."""
    epoch_loop = trainer.fit_loop.epoch_loop
    opt_loop = epoch_loop.automatic_optimization
    uninstall(trainer)
    original_run = opt_loop.run

    def make_zero_grad_fn(batch_idx: int, optimizer: Any) -> Optional[Callable[[], None]]:
        # copy of _AutomaticOptimization._make_zero_grad_fn (Lightning 2.6.6) with the modulo test replaced
        if opt_loop._skip_backward or not controller.zero_now:
            return None

        def zero_grad_fn() -> None:
            opt_loop._on_before_zero_grad(optimizer)
            opt_loop._optimizer_zero_grad(batch_idx, optimizer)

        return zero_grad_fn

    epoch_loop._should_accumulate = lambda: not controller.step_now
    opt_loop._make_zero_grad_fn = make_zero_grad_fn
    opt_loop.run = lambda optimizer, batch_idx, kwargs: controller.run_batch(original_run, optimizer, batch_idx, kwargs)


def uninstall(trainer: "pl.Trainer") -> None:
    """Remove the instance overrides, restoring Lightning's own methods."""
    epoch_loop = trainer.fit_loop.epoch_loop
    for name in _PATCHED:
        epoch_loop.__dict__.pop(name, None)
    for name in _PATCHED_OPT:
        epoch_loop.automatic_optimization.__dict__.pop(name, None)


def is_last_batch_of_epoch(trainer: "pl.Trainer") -> bool:
    """Lightning steps on the last batch of an epoch whatever the window: that ends a ragged window."""
    return trainer.fit_loop.epoch_loop._num_ready_batches_reached()


def step_metrics_written_now(trainer: "pl.Trainer") -> bool:
    """Whether Lightning will hand this training batch's ``on_step`` metrics to the loggers.

    Lightning 2.6.6 writes them only every ``log_every_n_steps`` optimizer steps (``_LoggerConnector
    .should_update_logs``, read in ``update_train_step_metrics`` right after ``on_train_batch_end``);
    ``self.log`` on the other batches costs ~0.7 ms per value on a CPU and is then overwritten unread.
    """
    return bool(trainer.fast_dev_run) or trainer._logger_connector.should_update_logs


def log_step_metrics(trainer: "pl.Trainer", pl_module: "pl.LightningModule", values: dict[str, float],
                     last_logged: dict[str, float]) -> None:
    """``pl_module.log`` (``on_step``, rank 0) the ``values`` that changed since ``last_logged``, and all of them
    on the steps the loggers are written, so ``trainer.callback_metrics`` is always current and every logger
    row has every value, at a fraction of the cost of logging all of them on every batch."""
    due = step_metrics_written_now(trainer)
    changed = {k: v for k, v in values.items() if due or last_logged.get(k) != v}
    if changed:
        pl_module.log_dict(changed, on_step=True, on_epoch=False, rank_zero_only=True)
        last_logged.update(changed)
