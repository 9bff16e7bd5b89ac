"""AccumulationScheduler through a real Trainer on CPU: equivalence, schedule timing, resume, OOM, auto, errors.

Tolerance: relative error of the parameter update <= 1e-6 in fp32. The accumulated and the one-batch
gradients sum the same per-item terms in a different order; fp32 rounding of those sums is ~1e-7.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.utils.data import DataLoader

from lit_speed.accumulation import AccumulationScheduler
from lit_speed.accumulation.micro_batch import measure_activation_model
from lit_speed.accumulation.window import head_batch
from tests.helpers.accumulation import (
    ManualModule,
    ResumableLoader,
    StepRecorder,
    TinyClassifier,
    TinyDataModule,
    TinyTokenLM,
    classification_data,
    fit,
    flat_params,
    rel_err,
    token_data,
    update,
)

TOL = 1e-6
warnings.filterwarnings("ignore", ".*does not have many workers.*")


def test_classification_micro_8x4_equals_batch_32():
    module, data = TinyClassifier(), classification_data(32)
    reference = update(module, DataLoader(data, batch_size=32), max_steps=1)
    accumulated = update(module, DataLoader(data, batch_size=8), [AccumulationScheduler(factors={0: 4})], max_steps=1)
    assert rel_err(accumulated, reference) <= TOL


def test_padded_token_loss_micro_8x4_equals_batch_32_where_lightning_does_not():
    module, data = TinyTokenLM(), token_data(32)
    reference = update(module, DataLoader(data, batch_size=32), max_steps=1)
    callback = AccumulationScheduler(factors={0: 4}, normalize="tokens")
    accumulated = update(module, DataLoader(data, batch_size=8), [callback], max_steps=1)
    assert rel_err(accumulated, reference) <= TOL
    # the test can fail: Lightning's built-in accumulation averages micro-batch means (Lightning #20350)
    builtin = update(module, DataLoader(data, batch_size=8), accumulate_grad_batches=4, max_steps=1)
    assert rel_err(builtin, reference) > 1e-2


def test_ragged_last_window_equals_one_batch_of_the_remainder():
    module, data = TinyClassifier(), classification_data(40)  # 5 micro-batches of 8: windows of 4 and 1
    reference = update(module, DataLoader(data, batch_sampler=[list(range(32)), list(range(32, 40))]))
    recorder = StepRecorder()
    accumulated = update(module, DataLoader(data, batch_size=8), [AccumulationScheduler(factors={0: 4}), recorder])
    assert [batches for _, batches in recorder.steps] == [[0, 1, 2, 3], [4]]
    assert rel_err(accumulated, reference) <= TOL
    builtin = update(module, DataLoader(data, batch_size=8), accumulate_grad_batches=4)  # Lightning #19987
    assert rel_err(builtin, reference) > 1e-2


def test_factor_changes_exactly_at_the_scheduled_step_and_is_logged():
    recorder = StepRecorder()
    callback = AccumulationScheduler(factors={0: 1, 3: 4})
    trainer = fit(TinyClassifier(), DataLoader(classification_data(40), batch_size=2), [callback, recorder])
    assert recorder.steps == [(0, [0]), (1, [1]), (2, [2]), (3, [3, 4, 5, 6]), (4, [7, 8, 9, 10]),
                              (5, [11, 12, 13, 14]), (6, [15, 16, 17, 18]), (7, [19])]
    assert recorder.factors == [1, 1, 1, 4, 4, 4, 4, 4]
    metrics = trainer.callback_metrics
    assert metrics["accumulation/factor"] == 4 and metrics["accumulation/micro_batch"] == 2
    assert metrics["accumulation/effective_batch"] == 8 and metrics["accumulation/items_in_window"] == 2
    assert callback.current_factor == 4


def test_every_logger_row_has_every_value_although_unchanged_values_are_not_logged_every_step(tmp_path):
    # self.log is called for changed values and on the steps the loggers write (log_every_n_steps): the CSV
    # must look as if every value had been logged on every step
    import csv

    from lightning.pytorch.loggers import CSVLogger

    recorder = StepRecorder()
    callback = AccumulationScheduler(factors={0: 1, 3: 4})
    fit(TinyClassifier(), DataLoader(classification_data(40), batch_size=2), [callback, recorder],
        logger=CSVLogger(tmp_path, name="csv"), log_every_n_steps=2)
    rows = [r for r in csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))) if r.get("accumulation/factor")]
    # 8 optimizer steps (3 of factor 1, then 4 of factor 4 and a ragged one): written after steps 2, 4, 6, 8
    assert [int(r["step"]) for r in rows] == [1, 3, 5, 7]
    expected = {1: (1, 2, 2), 3: (4, 8, 8), 5: (4, 8, 8), 7: (4, 8, 2)}  # factor, effective batch, items
    for r in rows:
        factor, effective, items = expected[int(r["step"])]
        assert float(r["accumulation/factor"]) == factor and float(r["accumulation/micro_batch"]) == 2
        assert float(r["accumulation/effective_batch"]) == effective
        assert float(r["accumulation/items_in_window"]) == items


def test_effective_batch_ramp_by_samples_with_linear_lr_scaling():
    recorder = StepRecorder()
    callback = AccumulationScheduler(effective_batch={0: 4, 16: 16}, unit="samples", lr_scaling="linear")
    module = TinyClassifier(lr=0.1)
    fit(module, DataLoader(classification_data(48), batch_size=4), [callback, recorder])
    # 4 steps of 4 samples reach 16 samples seen; then windows of 4 micro-batches
    assert [len(b) for _, b in recorder.steps] == [1, 1, 1, 1, 4, 4]  # 12 micro-batches
    assert module.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 16 / 4)


def test_resume_mid_window_ends_where_the_uninterrupted_run_ends(tmp_path):
    data = classification_data(40)
    batches = list(DataLoader(data, batch_size=4))  # 10 batches; windows [0] [1] [2,3,4] [5,6,7] [8,9]
    ckpt = tmp_path / "mid_window.ckpt"

    class SaveMidWindow(StepRecorder):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 6:  # second micro-batch of the window [5, 6, 7]
                trainer.save_checkpoint(ckpt)

    def run(ckpt_path=None):
        module = TinyClassifier(lr=0.3)
        module.configure_optimizers = lambda: torch.optim.SGD(module.parameters(), lr=0.3, momentum=0.9)
        callback = AccumulationScheduler(factors={0: 1, 2: 3})
        fit(module, ResumableLoader(batches), [callback, SaveMidWindow()], ckpt_path=ckpt_path)
        return module, callback

    uninterrupted, _ = run()
    state = torch.load(ckpt, weights_only=False)["callbacks"]
    saved = next(v for k, v in state.items() if k.startswith("AccumulationScheduler"))
    assert saved["pos"] == 2 and "partial_grads" in saved
    resumed, callback = run(ckpt_path=ckpt)
    assert resumed.trainer.global_step == uninterrupted.trainer.global_step == 5
    assert rel_err(flat_params(resumed), flat_params(uninterrupted)) <= TOL


def test_injected_oom_mid_window_retries_with_half_micro_batch_without_losing_a_step():
    data = classification_data(48)  # 6 batches of 8, windows of 2: steps 0, 1, 2
    clean = TinyClassifier()
    expected = update(clean, DataLoader(data, batch_size=8), [AccumulationScheduler(factors={0: 2})])
    module = TinyClassifier(oom_at_batch=5, oom_above=4)  # second micro-batch of the last window fails once
    callback = AccumulationScheduler(factors={0: 2})
    before = flat_params(module)
    trainer = fit(module, DataLoader(data, batch_size=8), [callback])
    assert module.oom_raised and trainer.global_step == 3
    # the failed window re-ran both of its batches as halves: 4 micro-batches of 4 at step 2
    assert [size for step, size in module.seen_batch_sizes if step == 2] == [8, 4, 4, 4, 4]
    assert callback.current_factor == 4 and callback.final_summary()["micro_batch"] == 4
    assert rel_err(flat_params(module) - before, expected) <= TOL


def test_oom_is_reraised_when_recovery_is_off():
    module = TinyClassifier(oom_at_batch=1, oom_above=4)
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        fit(module, DataLoader(classification_data(16), batch_size=8),
            [AccumulationScheduler(factors={0: 2}, oom_recovery=False)])


def test_auto_micro_batch_fits_the_budget_and_keeps_the_effective_batch():
    data = classification_data(64)
    module = TinyClassifier()
    # budget derived from the module's own activations: room for 8.5 samples -> 8 (a divisor of 32)
    per_sample, fixed = measure_activation_model(lambda b: module.training_step(b, 0), data[:8], head_batch)
    budget_mb = (fixed + 8.5 * per_sample) / 2**20
    dm = TinyDataModule(data, batch_size=16)
    callback = AccumulationScheduler(effective_batch={0: 32}, micro_batch="auto", memory_budget_mb=budget_mb)
    reference = update(module, DataLoader(data, batch_size=32), max_steps=2)
    start = copy.deepcopy(module)
    before = flat_params(start)
    trainer = fit(start, None, [callback], datamodule=dm, max_steps=2)
    assert dm.batch_size == 8 and callback.current_factor == 4
    assert trainer.callback_metrics["accumulation/effective_batch"] == 32
    assert rel_err(flat_params(start) - before, reference) <= TOL


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, match", [
    (dict(factors={0: 1, 10: 4, 5: 8}),
     r"AccumulationScheduler\(factors=.*\): factors keys must be strictly increasing"),
    (dict(factors={0: 0}),
     r"AccumulationScheduler\(factors=\{0: 0\}\): factors: every factor must be >= 1, got \[0\]"),
    (dict(), r"give exactly one of factors"),
    (dict(factors={0: 2}, effective_batch={0: 64}), r"give exactly one of factors"),
    (dict(factors={0: 2}, unit="batches"),
     r"AccumulationScheduler\(unit='batches'\): unit must be one of \('step', 'epoch', 'samples', 'tokens'\)"),
    (dict(factors={0: 2}, normalize="mean"), r"AccumulationScheduler\(normalize='mean'\): normalize must be one of"),
    (dict(factors={0: 2}, lr_scaling="cubic"),
     r"AccumulationScheduler\(lr_scaling='cubic'\): lr_scaling must be one of"),
    (dict(factors={0: 2}, micro_batch=0),
     r"AccumulationScheduler\(micro_batch=0\): micro_batch must be an int >= 1, 'auto' or None, got 0"),
    (dict(effective_batch={0: 64}, micro_batch="auto"), r"micro_batch='auto' needs .* memory_budget_mb > 0"),
])
def test_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AccumulationScheduler(**kwargs)


def test_effective_batch_not_divisible_by_micro_batch_times_world_size():
    with pytest.raises(ValueError, match=r"effective_batch\[0\] = 30 is not divisible by micro_batch \(8\) x world "
                                         r"size \(1\) = 8; use 24 or 32"):
        fit(TinyClassifier(), DataLoader(classification_data(32), batch_size=8),
            [AccumulationScheduler(effective_batch={0: 30})])


def test_refuses_trainer_accumulate_grad_batches_at_the_same_time():
    with pytest.raises(ValueError, match=r"Trainer\(accumulate_grad_batches=2\) and AccumulationScheduler both set"):
        fit(TinyClassifier(), DataLoader(classification_data(16), batch_size=8),
            [AccumulationScheduler(factors={0: 2})], accumulate_grad_batches=2)


def test_refuses_manual_optimization():
    with pytest.raises(ValueError, match="needs automatic optimization"):
        fit(ManualModule(), DataLoader(classification_data(16), batch_size=8), [AccumulationScheduler(factors={0: 2})])


def test_micro_batch_int_needs_a_datamodule_batch_size():
    with pytest.raises(ValueError, match=r"micro_batch=4 sets datamodule.batch_size, but NoneType has none"):
        fit(TinyClassifier(), DataLoader(classification_data(16), batch_size=8),
            [AccumulationScheduler(factors={0: 2}, micro_batch=4)])


def test_hydra_ramp_option_trains_through_the_runner(make_cfg):
    from lit_speed.run.runner import train

    cfg = make_cfg(["accumulation=ramp", "accumulation.factors=null", "accumulation.effective_batch=[[0,64],[4,128]]",
                    "trainer.max_steps=6", "trainer.max_epochs=1", "logger=none", "callbacks=none", "validate=false"])
    summary = train(cfg)
    assert summary["global_step"] == 6
    component = summary["components"]["AccumulationScheduler"]
    # steps 0-3 at 64 x 1, then the linear ramp reaches 128 = 64 x 2 at step 4
    assert component["factor"] == 2 and component["micro_batch"] == 64
    assert "linear ramp" in summary["startup"]["accumulation"]


def test_tokens_unit_counts_only_non_padding_targets_and_keeps_the_large_batch_update():
    """A schedule keyed by tokens counts what the loss averages over: targets != ignore_index, not padded slots."""
    module, data = TinyTokenLM(), token_data(32)
    real_tokens = int((data.tensors[1] != -100).sum())  # 32 x 10 slots, about half of them padding
    assert real_tokens < data.tensors[1].numel()
    reference = update(module, DataLoader(data, batch_size=32), max_steps=1)
    # one window of 4 padded micro-batches; the factor would drop to 2 after one more real token than it holds
    callback = AccumulationScheduler(factors={0: 4, real_tokens + 1: 2}, unit="tokens", normalize="tokens")
    module_copy = copy.deepcopy(module)
    before = flat_params(module_copy)
    fit(module_copy, DataLoader(data, batch_size=8), [callback], max_steps=1)
    assert rel_err(flat_params(module_copy) - before, reference) <= TOL
    assert callback.final_summary()["tokens_seen"] == real_tokens
    assert callback.current_factor == 4  # counting the 320 padded slots would have switched it to 2


# bf16-master keeps the accumulated gradients on the optimizer's float32 masters, not on the module's parameters:
# the window normalisation and a mid-window checkpoint must reach them there.
# Tolerance 0.03 (relative): the forward and backward run in bf16 (8-bit mantissa, ~0.4% per rounding), and the
# micro-batches round differently from the one large batch; a missing normalisation is off by x32 (the item count).
BF16_TOL = 0.03


def _bf16_master_update(loader, callbacks=(), **kwargs):
    from lit_speed import GuardedPrecision

    return update(TinyClassifier(), loader, list(callbacks), plugins=[GuardedPrecision("bf16-master")], **kwargs)


def test_bf16_master_micro_8x4_equals_batch_32_on_the_float32_masters():
    data = classification_data(32)
    reference = _bf16_master_update(DataLoader(data, batch_size=32), max_steps=1)
    accumulated = _bf16_master_update(DataLoader(data, batch_size=8), [AccumulationScheduler(factors={0: 4})],
                                      max_steps=1)
    assert rel_err(accumulated, reference) <= BF16_TOL


def test_bf16_master_resume_mid_window_is_bitwise_exact(tmp_path):
    from lit_speed import GuardedPrecision

    batches = list(DataLoader(classification_data(40), batch_size=4))  # windows [0] [1] [2,3,4] [5,6,7] [8,9]
    ckpt = tmp_path / "mid_window.ckpt"

    class SaveMidWindow(StepRecorder):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 6:
                trainer.save_checkpoint(ckpt)

    def run(ckpt_path=None):
        module = TinyClassifier(lr=0.3)
        fit(module, ResumableLoader(batches), [AccumulationScheduler(factors={0: 1, 2: 3}), SaveMidWindow()],
            ckpt_path=ckpt_path, plugins=[GuardedPrecision("bf16-master")])
        return module

    uninterrupted = run()
    saved = next(v for k, v in torch.load(ckpt, weights_only=False)["callbacks"].items()
                 if k.startswith("AccumulationScheduler"))
    grads = [g for group in saved["partial_grads"][0] for g in group if g is not None]
    assert grads and all(g.dtype == torch.float32 for g in grads)  # the masters' float32 partial sums
    resumed = run(ckpt_path=ckpt)
    assert torch.equal(flat_params(resumed), flat_params(uninterrupted))
