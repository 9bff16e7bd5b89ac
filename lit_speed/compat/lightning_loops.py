"""Private details of Lightning's fit loop, signal connector and checkpoint connector (Lightning 2.6.6).

Three groups, each an instance patch of one ``Trainer``'s loop objects (classes are untouched) or a read:

* **Resume at a finished epoch's end** (:func:`resume_finished_epoch_as_new_epoch`): ``_FitLoop.restarting``'s
  setter forces ``restarting=True`` whenever ``max_steps`` is set (``or self._iteration_based_training()``). A
  checkpoint written in ``on_train_epoch_end`` (``ModelCheckpoint`` when no validation ran at that epoch's end)
  then restarts *inside* the finished epoch: ``_TrainingEpochLoop.done`` waits for a validation that was never
  due (``_is_validation_done``), so one extra batch is trained and the epoch-end hooks run twice, shifting every
  later step by one. With ``max_epochs`` alone Lightning resumes such a checkpoint as a new epoch
  (``RESUMED_ON_EPOCH_END``); the patch takes that path with ``max_steps`` too, when the epoch's batches were
  all trained.
* **Stop signals** (:func:`replace_sigterm_notifier`, :func:`replace_stop_broadcast`, :func:`call_after_each_batch`):
  ``_SignalConnector._sigterm_notifier_fn`` (the SIGTERM handler's first part) runs a ``dist.broadcast`` inside
  the signal handler and forwards the signal to the launcher's children; ``_TrainingEpochLoop
  ._broadcast_sigterm_tensor`` broadcasts rank 0's flag at every batch start. A collective started from a signal
  handler pairs with whatever collective the other ranks run next (a DDP gradient all-reduce, a metric sync):
  both processes wait in a futex forever. The replacements let the handler only record the signal and decide the
  stop with one collective at a point every rank reaches in the same order (the end of each training batch).
* **Checkpoint contents** (:func:`dump_checkpoint`): ``trainer._checkpoint_connector.dump_checkpoint``, what
  ``Trainer.save_checkpoint`` writes.
"""
from __future__ import annotations

from typing import Any, Callable

import lightning.pytorch as pl
from lightning.pytorch.loops.loop import _Loop

_MARK = "_lit_speed_patch"  # marks our wrappers, so that each is installed once per loop


# ---------------------------------------------------------------------------------------------- resume
def resumed_inside_a_finished_epoch(trainer: "pl.Trainer") -> bool:
    """Whether the fit loop was restored from a checkpoint written after its epoch's last batch and its
    ``on_train_epoch_end`` hooks but before the epoch was counted complete (``epoch_progress``: processed = started =
    ready = completed + 1), with every batch of that epoch trained. Read before ``_FitLoop.reset``."""
    fit_loop = trainer.fit_loop
    total = fit_loop.epoch_progress.total
    at_epoch_end = (fit_loop._loaded_from_state_dict and total.started == total.ready
                    and total.processed == total.started and total.completed == total.processed - 1)
    if not at_epoch_end:
        return False
    batches = fit_loop.epoch_loop.batch_progress
    return bool(batches.is_last_batch or batches.current.ready >= trainer.num_training_batches)


def resume_finished_epoch_as_new_epoch(trainer: "pl.Trainer") -> None:
    """Make ``trainer.fit_loop.reset`` treat a finished epoch's end-of-epoch checkpoint as Lightning does without
    ``max_steps``: count that epoch complete and start the next one (see the module docstring). Installed once; a
    no-op for every other restart and for fresh runs."""
    fit_loop = trainer.fit_loop
    if getattr(fit_loop.reset, _MARK, False):
        return
    original = fit_loop.reset

    def reset() -> None:
        if fit_loop.restarting and resumed_inside_a_finished_epoch(trainer):
            _Loop.restarting.fset(fit_loop, False)  # the base setter: no "or iteration-based" (children follow)
        original()

    setattr(reset, _MARK, True)
    fit_loop.reset = reset


def uncount_batch_if_validation_skipped(trainer: "pl.Trainer") -> None:
    """For a checkpoint written after ``_TrainingEpochLoop.on_advance_end`` (a stop after its batch): if the restart
    skips that batch's validation, undo the step count Lightning adds again. Installed for the first batch only.

    Lightning 2.6.6 restarted "on last" at a validation batch returns from ``advance`` without a batch (the
    validation ran before the save) and its ``on_advance_end`` then adds 1 to ``_batches_that_stepped``: right for
    its own saves (in ``on_validation_end``, before that count), one too many for a save after it, so every later
    log row of the resumed run was one step late (measured: a 2-process run stopped at step 10 of 12 logged the
    epoch's ``train/acc`` at step 12, the uninterrupted run at 11).
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    original = epoch_loop.advance

    def advance(data_fetcher: Any) -> None:
        epoch_loop.advance = original
        ready = epoch_loop.batch_progress.total.ready
        original(data_fetcher)
        if epoch_loop._skip_next_val and epoch_loop.batch_progress.total.ready == ready:
            epoch_loop._batches_that_stepped -= 1  # on_advance_end adds it back

    epoch_loop.advance = advance


# ---------------------------------------------------------------------------------------------- stop signals
def replace_sigterm_notifier(trainer: "pl.Trainer", notifier: Callable[[int, Any], None]) -> None:
    """Make ``notifier(signum, frame)`` the first SIGTERM handler Lightning registers when fit starts, in place of
    ``_SignalConnector._sigterm_notifier_fn`` (which logs, forwards the signal to the launcher's children and runs a
    ``dist.broadcast`` from inside the handler). Call before fit's ``register_signal_handlers`` (e.g. in ``setup``).
    """
    trainer._signal_connector._sigterm_notifier_fn = notifier


def replace_stop_broadcast(trainer: "pl.Trainer", decide: Callable[[], None]) -> None:
    """Call ``decide()`` where ``_TrainingEpochLoop.advance`` broadcasts rank 0's SIGTERM flag at each batch start
    (several processes only), instead of that broadcast: ``decide`` runs its own agreement (or nothing)."""
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = decide


def call_after_each_batch(trainer: "pl.Trainer", hook: Callable[[], None]) -> None:
    """Call ``hook()`` at the end of ``_TrainingEpochLoop.on_advance_end`` (after a batch's validation, checkpoints
    and Lightning's own SIGTERM check; the state a stop at the next batch start would save). Installed once."""
    epoch_loop = trainer.fit_loop.epoch_loop
    if getattr(epoch_loop.on_advance_end, _MARK, False):
        return
    original = epoch_loop.on_advance_end

    def on_advance_end(data_fetcher: Any) -> None:
        original(data_fetcher)
        hook()

    setattr(on_advance_end, _MARK, True)
    epoch_loop.on_advance_end = on_advance_end


def training_done_after_this_batch(trainer: "pl.Trainer") -> bool:
    """Whether the epoch loop stops after the batch just run (its last batch, or ``max_steps``): Lightning then
    checks ``received_sigterm`` at the epoch's end (``_FitLoop.on_advance_end``), not after the batch."""
    return bool(trainer.fit_loop.epoch_loop._is_training_done)


def set_received_sigterm(trainer: "pl.Trainer", value: bool = True) -> None:
    """``trainer._signal_connector.received_sigterm``: the flag the loops raise ``SIGTERMException`` on."""
    trainer._signal_connector.received_sigterm = value


# ---------------------------------------------------------------------------------------------- checkpoints
def dump_checkpoint(trainer: "pl.Trainer") -> dict[str, Any]:
    """What ``Trainer.save_checkpoint`` would write now (``trainer._checkpoint_connector.dump_checkpoint()``): the
    callbacks' and the module's ``on_save_checkpoint`` hooks run; tensors are the live ones, not copies."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def in_epoch_end_hooks(trainer: "pl.Trainer") -> bool:
    """Whether the fit loop is inside ``_FitLoop.on_advance_end`` before its epoch counts complete (the
    ``on_train_epoch_end`` hooks run there): its logged metrics are written and reset right after."""
    if not trainer.training or trainer.sanity_checking or trainer._logger_connector._first_loop_iter is not None:
        return False
    epochs = trainer.fit_loop.epoch_progress.total
    return epochs.processed == epochs.started and epochs.completed == epochs.processed - 1


def log_row_written_after_this_hook(trainer: "pl.Trainer") -> tuple[dict[str, Any], int, int] | None:
    """The row Lightning's logger connector will write right after the training hook now running, as
    ``(metrics, epoch, step)``; ``None`` when it writes none there.

    Lightning 2.6.6 logs a training batch's ``on_step`` values in ``update_train_step_metrics`` (after the
    ``on_train_batch_end`` hooks, when the batch stepped and ``should_update_logs``) and the epoch's ``on_epoch``
    values in ``update_train_epoch_metrics`` (after the ``on_train_epoch_end`` hooks, at ``_batches_that_stepped - 1``).
    A checkpoint written inside those hooks (``ModelCheckpoint`` every N steps, or at an epoch's end without
    validation) is therefore written before the row, and a run resumed from it never writes that row.
    """
    if not trainer.training or trainer.sanity_checking:
        return None
    connector = trainer._logger_connector
    fit_loop = trainer.fit_loop
    epoch_loop = fit_loop.epoch_loop
    steps_logged = epoch_loop._batches_that_stepped
    if connector._first_loop_iter is None:  # between the epoch's last batch and its end
        if not in_epoch_end_hooks(trainer):
            return None
        return dict(connector.metrics["log"]), trainer.current_epoch, steps_logged - 1
    batches = epoch_loop.batch_progress.current
    in_batch_end = batches.processed == batches.ready and batches.completed == batches.processed - 1
    if not in_batch_end or (fit_loop._should_accumulate() and trainer.lightning_module.automatic_optimization):
        return None
    if not (connector.should_update_logs or trainer.fast_dev_run):
        return None
    return dict(connector.metrics["log"]), trainer.current_epoch, steps_logged


def around_each_save(trainer: "pl.Trainer", before: Callable[[], None], after: Callable[[float], None]) -> None:
    """Call ``before()`` when ``trainer.strategy.save_checkpoint`` starts and ``after(seconds)`` when it returns (an
    instance wrapper of that public method: Lightning 2.6.6 calls it from ``Trainer.save_checkpoint`` on every
    process). Installed once per strategy."""
    import time

    strategy = trainer.strategy
    if getattr(strategy.save_checkpoint, _MARK, False):
        return
    original = strategy.save_checkpoint

    def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
        before()
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            after(time.perf_counter() - start)

    setattr(save_checkpoint, _MARK, True)
    strategy.save_checkpoint = save_checkpoint
