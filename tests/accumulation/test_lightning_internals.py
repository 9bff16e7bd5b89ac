"""Fails loudly if the Lightning internals ``lit_speed.accumulation.lightning_internals`` relies on change.

Written against Lightning 2.6.6. If one of these fails after a Lightning upgrade, re-read the named
method and update ``lightning_internals.py`` (and this test) together.
"""
from __future__ import annotations

import inspect

from lightning.pytorch.loops.optimization.automatic import _AutomaticOptimization, ClosureResult
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from torch.utils.data import DataLoader

from tests.helpers.accumulation import TinyClassifier, classification_data, fit
from lit_speed.accumulation import AccumulationScheduler


def _source(fn) -> str:
    return "".join(inspect.getsource(fn).split())  # whitespace-insensitive


def test_epoch_loop_routes_every_accumulation_decision_through_should_accumulate():
    assert "self._should_accumulate()" in inspect.getsource(_TrainingEpochLoop.update_lr_schedulers)
    assert "self._should_accumulate()" in inspect.getsource(_TrainingEpochLoop.on_advance_end)
    assert "notaccumulation_doneandstrategy_accumulates_on_final_batch" in _source(_TrainingEpochLoop._should_accumulate)
    assert "epoch_finished_on_ready" in _source(_TrainingEpochLoop._num_ready_batches_reached)


def test_automatic_optimization_decisions_we_replace_are_unchanged():
    # zero-grad is decided by the batch index modulo the factor; our copy replaces only that test
    zero = _source(_AutomaticOptimization._make_zero_grad_fn)
    assert "is_first_batch_to_accumulate=batch_idx%self.trainer.accumulate_grad_batches==0" in zero
    assert "self._on_before_zero_grad(optimizer)" in zero and "self._optimizer_zero_grad(batch_idx,optimizer)" in zero
    run = _source(_AutomaticOptimization.run)
    assert "self.trainer.fit_loop._should_accumulate()" in run
    assert "_block_parallel_sync_behavior(self.trainer.strategy,block=True)" in run  # DDP no_sync on accumulation
    assert list(inspect.signature(_AutomaticOptimization.run).parameters) == ["self", "optimizer", "batch_idx", "kwargs"]
    # the loss is divided by accumulate_grad_batches, which on_before_backward's weight undoes
    assert "trainer.accumulate_grad_batches)" in _source(_AutomaticOptimization._training_step)
    assert "closure_loss=closure_loss/normalize" in _source(ClosureResult.from_training_step_output)


def test_install_shadows_instance_methods_only_and_uninstall_restores_them():
    trainer = fit(TinyClassifier(), DataLoader(classification_data(16), batch_size=8),
                  [AccumulationScheduler(factors={0: 2})])
    epoch_loop = trainer.fit_loop.epoch_loop
    assert "_should_accumulate" not in vars(epoch_loop)
    assert not {"run", "_make_zero_grad_fn"} & set(vars(epoch_loop.automatic_optimization))
    assert type(epoch_loop)._should_accumulate is _TrainingEpochLoop._should_accumulate
