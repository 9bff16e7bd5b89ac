"""GuardedPrecision through a real Trainer on a tiny regression: fault injection, fallback, raise, resume,
clipping on unscaled gradients, LR scheduler on skipped steps, telemetry, Hydra options, ZeRO composition."""
from __future__ import annotations

import csv
from pathlib import Path

import hydra
import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_speed import GuardedPrecision
from lit_speed.precision import modes
from lit_speed.precision.probe import cpu_has_native_bf16, measure_slowdown

N_BATCHES = 5  # batches per epoch


class FaultyRegressor(pl.LightningModule):
    """A Linear regression whose loss is multiplied by ``value`` (inf or nan) at the given global steps."""

    def __init__(self, bad_steps: tuple[int, ...] = (), value: float = float("inf"), lr: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(8, 1)
        self.bad_steps, self.value, self.lr = set(bad_steps), value, lr
        self.weights: list[torch.Tensor] = []     # weights after each optimizer step (skipped or not)
        self.out_dtypes: list[torch.dtype] = []   # dtype of the Linear's output in each training step
        self.grad_norms: list[float] = []         # total grad norm seen before clipping
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.layer(x)
        self.out_dtypes.append(out.dtype)
        loss = F.mse_loss(out.float(), y)
        return loss * self.value if self.global_step in self.bad_steps else loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.grad_norms.append(float(torch.cat([p.grad.flatten() for p in self.parameters()]).norm()))

    def on_train_batch_end(self, *args) -> None:
        self.weights.append(self.layer.weight.detach().clone())

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(8 * N_BATCHES, 8, generator=g), torch.randn(8 * N_BATCHES, 1, generator=g))
        return DataLoader(data, batch_size=8, shuffle=False)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.scheduler, "interval": "step"}}


def fit(plugin: GuardedPrecision, module: pl.LightningModule, max_steps: int = -1, tmp_path: Path | None = None,
        ckpt_path: str | None = None, **kwargs) -> pl.Trainer:
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, plugins=[plugin],
                         logger=CSVLogger(tmp_path, name="csv") if tmp_path else False, log_every_n_steps=1,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, **kwargs)
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


def test_inf_step_is_skipped_scale_backs_off_weights_unchanged_and_training_goes_on(tmp_path: Path) -> None:
    module = FaultyRegressor(bad_steps=(2,))
    plugin = GuardedPrecision("16-mixed", init_scale=1024.0)  # 1024: no fp16 overflow of its own on this model
    fit(plugin, module, max_steps=5, tmp_path=tmp_path)
    w = module.weights
    assert torch.equal(w[2], w[1])                                   # the inf step never reached the weights
    assert not torch.equal(w[1], w[0]) and not torch.equal(w[3], w[2])  # real steps before and after it
    assert plugin.scaler.get_scale() == 512.0                         # backed off once: 1024 x 0.5
    assert (plugin.counters.skipped_steps, plugin.counters.attempted_steps, plugin.mode) == (1, 5, "16-mixed")
    assert module.out_dtypes == [torch.float16] * 5
    # Lightning #18828: the LR schedule advanced 4 times for 4 real steps, not 5
    assert module.scheduler.last_epoch == 4
    rows = list(csv.DictReader((tmp_path / "csv" / "version_0" / "metrics.csv").open()))
    last = [r for r in rows if r.get("precision/skipped_steps")][-1]
    assert float(last["precision/skipped_steps"]) == 1.0 and float(last["precision/loss_scale"]) == 512.0
    assert float(last["precision/nonfinite_rate"]) == pytest.approx(1 / 5)
    assert float(last["precision/mode"]) == modes.MODE_CODES["16-mixed"]


def test_nan_for_n_steps_under_fallback_switches_mode_and_finishes_finite(monkeypatch: pytest.MonkeyPatch) -> None:
    # the fallback picks bf16-mixed where the CPU has bf16 matmul units (32-true elsewhere: the test after this one)
    monkeypatch.setattr("lit_speed.precision.guarded_precision.cpu_has_native_bf16", lambda: True)
    module = FaultyRegressor(bad_steps=(1, 2, 3), value=float("nan"))
    plugin = GuardedPrecision("16-mixed", on_nonfinite="fallback", fallback_after=3, init_scale=1024.0)
    with pytest.warns(UserWarning, match=r"3 consecutive non-finite steps under 16-mixed \(last at step 3: "
                                         r"loss=nan.*continuing in bf16-mixed"):
        trainer = fit(plugin, module, max_steps=7)
    assert trainer.precision_plugin.precision == "bf16-mixed" and plugin.scaler is None
    assert module.out_dtypes == [torch.float16] * 4 + [torch.bfloat16] * 3
    assert plugin.counters.fallbacks[0]["step"] == 3 and plugin.counters.skipped_steps == 3
    assert all(torch.equal(module.weights[i], module.weights[0]) for i in (1, 2, 3))
    assert torch.isfinite(module.layer.weight).all() and not torch.equal(module.weights[-1], module.weights[3])


def test_fallback_on_a_cpu_without_bf16_units_continues_in_32_true(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("lit_speed.precision.guarded_precision.cpu_has_native_bf16", lambda: False)
    module = FaultyRegressor(bad_steps=(1, 2, 3), value=float("nan"))
    plugin = GuardedPrecision("16-mixed", on_nonfinite="fallback", fallback_after=3, init_scale=1024.0)
    with pytest.warns(UserWarning, match=r"continuing in 32-true"):
        trainer = fit(plugin, module, max_steps=7)
    assert trainer.precision_plugin.precision == "32-true" and module.out_dtypes[4:] == [torch.float32] * 3


def test_a_skipped_accumulation_window_is_dropped_whole_and_the_next_starts_clean() -> None:
    module = FaultyRegressor(bad_steps=(1,), value=float("nan"))  # optimizer step 1 = batches 2 and 3
    plugin = GuardedPrecision("32-true", on_nonfinite="skip")
    fit(plugin, module, max_steps=3, accumulate_grad_batches=2)
    w = module.weights  # one entry per batch: 0 1 | 2 3 | 4
    assert torch.equal(w[3], w[1]) and not torch.equal(w[1], w[0]) and not torch.equal(w[4], w[3])
    assert torch.isfinite(w[4]).all()  # the NaN gradients of window 1 were not carried into window 2
    assert (plugin.counters.attempted_steps, plugin.counters.skipped_steps) == (3, 1)
    assert module.scheduler.last_epoch == 2  # the schedule advanced for the 2 real steps only


def test_raise_stops_with_the_step_the_value_and_what_to_try() -> None:
    module = FaultyRegressor(bad_steps=(2,))
    plugin = GuardedPrecision("16-mixed", on_nonfinite="raise", init_scale=1024.0)
    with pytest.raises(FloatingPointError, match=r"non-finite values at step 2 under 16-mixed \(loss=inf.*"
                                                 r"on_nonfinite='raise' stops here\. Try on_nonfinite=fallback"):
        fit(plugin, module, max_steps=5)


def test_32_true_guard_keeps_a_nan_step_out_of_the_weights() -> None:
    module = FaultyRegressor(bad_steps=(1,), value=float("nan"))
    plugin = GuardedPrecision("32-true", on_nonfinite="skip")
    fit(plugin, module, max_steps=3)
    assert torch.equal(module.weights[1], module.weights[0]) and not torch.equal(module.weights[2], module.weights[1])
    assert plugin.counters.skipped_steps == 1 and plugin.scaler is None


def test_clipping_sees_unscaled_gradients() -> None:
    runs = {}
    for mode in ("32-true", "16-mixed"):
        module = FaultyRegressor()
        fit(GuardedPrecision(mode, init_scale=1024.0), module, max_steps=1, gradient_clip_val=0.01)
        runs[mode] = module
    # the hook (and the clipping after it) see true gradients, not gradients x 1024
    assert runs["16-mixed"].grad_norms[0] == pytest.approx(runs["32-true"].grad_norms[0], rel=1e-2)
    assert runs["16-mixed"].grad_norms[0] > 0.01  # so clipping really acted
    # SGD, lr 0.1, gradient clipped to norm 0.01: the update has norm 0.1 x 0.01 (1/1024 of it if clipped scaled)
    start = FaultyRegressor()
    moved = torch.cat([(runs["16-mixed"].layer.weight - start.layer.weight).detach().flatten(),
                       (runs["16-mixed"].layer.bias - start.layer.bias).detach().flatten()]).norm()
    assert float(moved) == pytest.approx(0.1 * 0.01, rel=1e-2)


def test_bf16_true_keeps_weights_in_bf16() -> None:
    module = FaultyRegressor()
    fit(GuardedPrecision("bf16-true"), module, max_steps=2)
    assert module.layer.weight.dtype == torch.bfloat16 and module.out_dtypes == [torch.bfloat16] * 2
    assert not torch.equal(module.weights[1], module.weights[0])


def test_auto_resolves_on_the_trainer_device_with_the_same_rule_as_the_pure_function() -> None:
    """The rule decides where it rules bf16 out; on a CPU with native bf16 the first training batch is timed."""
    plugin = GuardedPrecision("auto")
    fit(plugin, FaultyRegressor(), max_steps=1)
    native = cpu_has_native_bf16()
    expected = modes.choose_auto_mode("cpu", False, native, measure_slowdown(torch.bfloat16) if native else None, 2.0)
    if expected[0] == "32-true":
        assert (plugin.mode, plugin.reason) == expected
        assert plugin.describe()["precision"] == f"{expected[0]} ({expected[1]})"
    else:
        assert plugin.mode in modes.TIMED_CANDIDATES
        assert plugin.reason.startswith("timed this model's step on one micro-batch: 32-true ")


class _Recorder(pl.Callback):
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        plugin = trainer.precision_plugin
        self.state = (plugin.mode, plugin.metrics()["precision/loss_scale"], plugin.counters.skipped_steps)


def test_resume_keeps_the_scaler_state(tmp_path: Path) -> None:
    first = FaultyRegressor(bad_steps=(1,))
    trainer = fit(GuardedPrecision("16-mixed", init_scale=1024.0), first, max_epochs=1)
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    saved = torch.load(tmp_path / "a.ckpt", weights_only=False)
    assert saved["GuardedPrecision"]["scaler"]["scale"] == 512.0  # Lightning stores plugin state by class name
    recorder = _Recorder()
    fit(GuardedPrecision("16-mixed", init_scale=1024.0), FaultyRegressor(), max_epochs=2,
        ckpt_path=str(tmp_path / "a.ckpt"), callbacks=[recorder])
    assert recorder.state == ("16-mixed", 512.0, 1)


def test_resume_after_fallback_continues_in_the_fallen_back_mode_and_ends_where_the_full_run_ends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("lit_speed.precision.guarded_precision.cpu_has_native_bf16", lambda: True)
    def plugin() -> GuardedPrecision:
        return GuardedPrecision("16-mixed", fallback_after=3, init_scale=1024.0)

    # whole epochs: a run stopped by max_steps on an epoch boundary resumes into a half-counted epoch (Lightning)
    full = FaultyRegressor(bad_steps=(1, 2, 3), value=float("nan"))
    with pytest.warns(UserWarning, match="continuing in bf16-mixed"):
        fit(plugin(), full, max_epochs=2)
    head = FaultyRegressor(bad_steps=(1, 2, 3), value=float("nan"))
    with pytest.warns(UserWarning, match="continuing in bf16-mixed"):
        trainer = fit(plugin(), head, max_epochs=1)
    trainer.save_checkpoint(tmp_path / "b.ckpt")
    tail, recorder = FaultyRegressor(), _Recorder()
    resumed = fit(plugin(), tail, max_epochs=2, ckpt_path=str(tmp_path / "b.ckpt"), callbacks=[recorder])
    assert recorder.state == ("bf16-mixed", 1.0, 3)
    assert resumed.precision_plugin.precision == "bf16-mixed" and tail.out_dtypes == [torch.bfloat16] * N_BATCHES
    assert torch.equal(tail.layer.weight, full.layer.weight) and torch.equal(tail.layer.bias, full.layer.bias)


def test_every_hydra_option_builds_the_plugin() -> None:
    from lit_speed.run.config_check import group_options, preflight

    assert set(group_options("precision")) >= {"32-true", "bf16-mixed", "16-mixed", "bf16-true", "auto"}
    for option in group_options("precision"):
        plugin = hydra.utils.instantiate(preflight([f"precision={option}"]).precision)
        assert isinstance(plugin, GuardedPrecision) and plugin.requested_mode == option


def test_zero_strategy_takes_precision_over_from_the_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from lightning.pytorch.plugins.precision import DeepSpeedPrecision

    from lit_speed.strategies.zero_strategy import ZeroStrategy

    plugin = GuardedPrecision("bf16-mixed", on_nonfinite="skip")
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=2), plugins=[plugin],
                         logger=False, enable_checkpointing=False)
    # DeepSpeed owns bf16 and loss scaling there: the plugin is replaced, never stacked (no double scaler)
    assert isinstance(trainer.precision_plugin, DeepSpeedPrecision)
    assert trainer.precision_plugin.precision == "bf16-mixed"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: fp16 autocast + GradScaler on cuda")
def test_16_mixed_on_cuda_skips_an_inf_step_and_backs_off() -> None:
    module = FaultyRegressor(bad_steps=(2,))
    plugin = GuardedPrecision("16-mixed", init_scale=1024.0)
    pl.Trainer(accelerator="gpu", devices=1, max_steps=4, plugins=[plugin], logger=False, enable_checkpointing=False,
               enable_progress_bar=False, num_sanity_val_steps=0, limit_val_batches=0).fit(module)
    assert torch.equal(module.weights[2], module.weights[1]) and plugin.scaler.get_scale() == 512.0
    assert module.out_dtypes == [torch.float16] * 4 and plugin.device_type == "cuda"
