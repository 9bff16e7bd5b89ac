"""Private Lightning loop, trainer and module internals (written against Lightning 2.6.6).

Per-step accumulation: Lightning decides accumulation from ``batch_idx % accumulate_grad_batches`` inside the
epoch, so windows must line up with multiples of a factor fixed for the whole epoch. A factor that changes at
an optimizer step, a ragged window, or a window retried after an OOM needs the decisions made by a controller
instead. :func:`install_accumulation_controller` shadows three *instance* attributes (classes are untouched, and
:func:`uninstall_accumulation_controller` removes them):

* ``trainer.fit_loop.epoch_loop._should_accumulate()`` -> ``not controller.step_now``. It gates the optimizer
  step, DDP's ``no_sync`` on non-boundary micro-batches, LR-scheduler stepping, and the logger's step counter.
* ``trainer.fit_loop.epoch_loop.automatic_optimization._make_zero_grad_fn`` -> zero only when
  ``controller.zero_now`` (body copied from Lightning 2.6.6).
* ``trainer.fit_loop.epoch_loop.automatic_optimization.run`` -> ``controller.run_batch(original_run, ...)``,
  so a batch can be split into smaller micro-batches (after an OOM) and retried.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Protocol

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, Strategy

_PATCHED = ("_should_accumulate",)
_PATCHED_OPT = ("_make_zero_grad_fn", "run")


class AccumulationController(Protocol):
    """What :func:`install_accumulation_controller` reads: the decisions for the micro-batch now running."""

    step_now: bool
    zero_now: bool

    def run_batch(self, run: Callable[..., Any], optimizer: Any, batch_idx: int, kwargs: Any) -> Any: ...


# ---------------------------------------------------------------------------------------------- accumulation
def install_accumulation_controller(trainer: "pl.Trainer", controller: AccumulationController) -> None:
    """Route Lightning 2.6.6's accumulation decisions for ``trainer`` to ``controller`` (see the module docstring)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    opt_loop = epoch_loop.automatic_optimization
    uninstall_accumulation_controller(trainer)
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


def uninstall_accumulation_controller(trainer: "pl.Trainer") -> None:
    """Remove the instance overrides, restoring Lightning's own methods."""
    epoch_loop = trainer.fit_loop.epoch_loop
    for name in _PATCHED:
        epoch_loop.__dict__.pop(name, None)
    for name in _PATCHED_OPT:
        epoch_loop.automatic_optimization.__dict__.pop(name, None)


def should_accumulate(trainer: "pl.Trainer") -> bool:
    """Whether Lightning will skip the optimizer step after the current batch (Lightning 2.6.6:
    ``trainer.fit_loop._should_accumulate()``; with a strategy that handles accumulation it is
    ``not (batch_progress.current.ready % accumulate_grad_batches == 0)``)."""
    return trainer.fit_loop._should_accumulate()


def is_last_batch_of_epoch(trainer: "pl.Trainer") -> bool:
    """Lightning steps on the last batch of an epoch whatever the window: that ends a ragged window
    (Lightning 2.6.6: ``_TrainingEpochLoop._num_ready_batches_reached``)."""
    return trainer.fit_loop.epoch_loop._num_ready_batches_reached()


def step_metrics_written_now(trainer: "pl.Trainer") -> bool:
    """Whether Lightning will hand this training batch's ``on_step`` metrics to the loggers.

    Lightning 2.6.6 writes them only every ``log_every_n_steps`` optimizer steps (``_LoggerConnector
    .should_update_logs``, read in ``update_train_step_metrics`` right after ``on_train_batch_end``);
    ``self.log`` on the other batches costs ~0.7 ms per value on a CPU and is then overwritten unread.
    """
    return bool(trainer.fast_dev_run) or trainer._logger_connector.should_update_logs


def validate_after_this_batch(trainer: "pl.Trainer", due: bool) -> None:
    """Make Lightning validate after the training batch now ending exactly when ``due`` (call it from
    ``on_train_batch_end``).

    Lightning 2.6.6 decides in ``_TrainingEpochLoop._should_check_val_fx`` (``on_advance_end``, after the batch's
    ``on_train_batch_end``): ``(current_iteration + 1) % trainer.val_check_batch == 0``, where ``current_iteration``
    is ``total_batch_idx`` without ``check_val_every_n_epoch``, else ``batch_idx``. Setting ``trainer.val_check_batch``
    to that count (or to one it cannot divide) gives the decision; its other triggers (a stop request, an infinite
    loader's last batch) and ``check_val_every_n_epoch``'s epoch gate are left as they are.
    """
    loop = trainer.fit_loop.epoch_loop
    iteration = (loop.total_batch_idx if trainer.check_val_every_n_epoch is None else loop.batch_idx) + 1
    trainer.val_check_batch = iteration if due else iteration + 2**40  # never divides iteration


# ---------------------------------------------------------------------------------------------- trainer and module
def request_stop(trainer: "pl.Trainer") -> None:
    """Ask the loops to stop at the next batch boundary, exactly as a SIGTERM does.

    Lightning 2.6.6: the loops read ``trainer.received_sigterm``, which is
    ``trainer._signal_connector.received_sigterm``; setting it reuses their stop points and their
    cross-process broadcast.
    """
    trainer._signal_connector.received_sigterm = True


def attached_trainer(module: Any) -> "pl.Trainer | None":
    """The Trainer a LightningModule is attached to, ``None`` if none, without the error ``module.trainer``
    raises when detached (Lightning 2.6.6: ``LightningModule._trainer``)."""
    return getattr(module, "_trainer", None)


@contextmanager
def detached_from_trainer(module: Any) -> Iterator[None]:
    """Detach a LightningModule from its Trainer for the ``with`` block (e.g. to ``deepcopy`` the model
    without the Trainer), re-attaching it after (Lightning 2.6.6: ``LightningModule._trainer``)."""
    trainer = getattr(module, "_trainer", None)
    if trainer is not None:
        module._trainer = None
    try:
        yield
    finally:
        if trainer is not None:
            module._trainer = trainer


@contextmanager
def muted_log(module: "pl.LightningModule") -> Iterator[None]:
    """``module.log`` does nothing inside the ``with`` block (an instance patch, removed after): a
    ``training_step`` run outside Lightning's loop, where ``self.log`` raises, can then be timed or probed."""
    module.log = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del module.log


def run_before_step_hooks_and_clipping(plugin: Precision, model: "pl.LightningModule", optimizer: Any) -> None:
    """``on_before_optimizer_step`` hooks, then gradient clipping, as a precision plugin runs them after the
    closure (Lightning 2.6.6: ``Precision._after_closure(model, optimizer)``; ``MixedPrecision`` calls it so)."""
    plugin._after_closure(model, optimizer)


def wrapped_optimizer(wrapper: Any) -> Any:
    """The optimizer inside ``wrapper``: its ``.optimizer`` (Lightning's ``LightningOptimizer``, DeepSpeed's engine
    and ZeRO optimizers), else its private ``._optimizer`` (Lightning 2.6.6 optimizer wrappers keep the wrapped
    one there); ``None`` for a plain optimizer."""
    return getattr(wrapper, "optimizer", None) or getattr(wrapper, "_optimizer", None)


# ---------------------------------------------------------------------------------------------- strategies
def get_precision_plugin(strategy: Strategy) -> Precision:
    """``Strategy.precision_plugin``'s getter, for a subclass that overrides the property (Lightning 2.6.6: no
    class between ``Strategy`` and ``DeepSpeedStrategy`` overrides it)."""
    return Strategy.precision_plugin.fget(strategy)


def set_precision_plugin(strategy: Strategy, plugin: Precision | None) -> None:
    """``Strategy.precision_plugin``'s setter, for a subclass that overrides the property."""
    Strategy.precision_plugin.fset(strategy, plugin)


def setup_environment_as_ddp(strategy: DDPStrategy) -> None:
    """``DDPStrategy.setup_environment`` on a ``DeepSpeedStrategy`` subclass, skipping ``DeepSpeedStrategy``'s own
    (Lightning 2.6.6: it only adds a CUDA-accelerator check before calling ``super().setup_environment()``)."""
    DDPStrategy.setup_environment(strategy)


# ---------------------------------------------------------------------------------------------- ModelCheckpoint
def step_last_saved(callback: Any) -> int:
    """The global step at which ``callback`` (a ``ModelCheckpoint``) last wrote a checkpoint file, of any kind
    (Lightning 2.6.6 keeps it as ``_last_global_step_saved``; 0 before the first save)."""
    return int(callback._last_global_step_saved)


def save_last_checkpoint(callback: Any, trainer: "pl.Trainer") -> None:
    """Write ``callback``'s ``last.ckpt`` now, exactly as ``ModelCheckpoint`` does after a top-k save (Lightning
    2.6.6: ``_save_last_checkpoint(trainer, _monitor_candidates(trainer))``)."""
    callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))


def checkpoint_due(callback: Any, trainer: "pl.Trainer", hook: str) -> bool:
    """Whether ``callback`` (a ``ModelCheckpoint``) would write a checkpoint in ``hook`` at this point of training,
    by Lightning 2.6.6's own rules (``_should_skip_saving_checkpoint``, ``_should_save_on_train_epoch_end``,
    ``_every_n_train_steps``, ``_every_n_epochs``), ignoring whether it saved already at this step."""
    from lightning.pytorch.trainer.states import TrainerFn

    if trainer.fast_dev_run or trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking:
        return False
    if hook == "on_train_batch_end":
        n = callback._every_n_train_steps
        return bool(n) and n > 0 and trainer.global_step % n == 0
    epoch_due = callback._every_n_epochs >= 1 and (trainer.current_epoch + 1) % callback._every_n_epochs == 0
    on_epoch_end = callback._should_save_on_train_epoch_end(trainer)
    if hook == "on_train_epoch_end":
        return on_epoch_end and epoch_due
    if hook == "on_validation_end":
        return not on_epoch_end and epoch_due
    return hook == "on_train_end"
