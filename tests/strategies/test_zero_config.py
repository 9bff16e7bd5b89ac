"""ZeroStrategy's functional core and up-front validation: no Trainer, no process group, seconds."""
from __future__ import annotations

import os
import warnings
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from lit_speed.memory.model_state import ZeroLayout, model_state_bytes  # noqa: E402
from lit_speed.strategies.memory_estimate import format_bytes, measured_optimizer_state_bytes  # noqa: E402
from lit_speed.strategies.zero_config import (  # noqa: E402
    check_offload_optimizer,
    check_precision,
    fp16_section,
    merge_config,
    validate_config,
)
from lit_speed.strategies.zero_strategy import ZeroStrategy  # noqa: E402


# -- memory estimate: DeepSpeed's formulas (the one calculator, lit_speed.memory.model_state) ----------------------
def estimate_zero_memory(n: int, stage: int, world_size: int = 1, precision: str = "32-true",
                         offload_optimizer: bool = False, offload_parameters: bool = False):
    """Adam's states as a DeepSpeed engine holds them (stage 0: DeepSpeed without ZeRO, the DDP row)."""
    layout = ZeroLayout(stage, offload_optimizer, offload_parameters, deepspeed=True)
    return model_state_bytes(n, precision, 2, layout, world_size)


@pytest.mark.parametrize("precision, weight, optim", [("32-true", 4, 8), ("bf16-mixed", 2, 12)])
def test_estimate_follows_the_zero_paper(precision: str, weight: int, optim: int) -> None:
    n, world = 1_000_000, 4
    ddp = estimate_zero_memory(n, 0, world, precision)
    assert (ddp.params, ddp.grads, ddp.optimizer) == (weight * n, weight * n, optim * n)
    s1, s2, s3 = (estimate_zero_memory(n, s, world, precision) for s in (1, 2, 3))
    assert s1.optimizer == optim * n // world and s1.grads == weight * n
    assert s2.grads == weight * n // world and s2.params == weight * n
    assert s3.params == weight * n // world
    assert ddp.total > s1.total > s2.total > s3.total


def test_estimate_offload_moves_states_to_host() -> None:
    n = 1000
    est = estimate_zero_memory(n, 3, 2, "bf16-mixed", offload_optimizer=True, offload_parameters=True)
    assert est.host == est.optimizer + est.params
    assert est.device == est.grads
    # parameter offload means nothing below stage 3 (ZeRO keeps full weights on every rank there)
    assert estimate_zero_memory(n, 2, 2, offload_parameters=True).host == 0


def test_estimate_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match=r"stage must be one of \(0, 1, 2, 3\), got 4"):
        estimate_zero_memory(10, 4)
    with pytest.raises(ValueError, match="precision must be one of"):
        estimate_zero_memory(10, 1, precision="fp8")
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        estimate_zero_memory(10, 1, world_size=0)


def test_measured_state_bytes_counts_adam_moments_not_step() -> None:
    w = torch.nn.Parameter(torch.randn(10, 3))
    opt = torch.optim.AdamW([w])
    assert measured_optimizer_state_bytes(opt) == 0  # no state before the first step
    w.grad = torch.ones_like(w)
    opt.step()
    assert measured_optimizer_state_bytes(opt) == 2 * 30 * 4
    assert measured_optimizer_state_bytes(SimpleNamespace(optimizer=opt)) == 240  # unwraps ZeRO-style wrappers
    assert format_bytes(1536) == "1.5 KiB" and format_bytes(12) == "12 B"


# -- raw config validation (DeepSpeed #1935: misplaced keys are silent no-ops) -------------------------------
def test_unknown_top_level_key_is_refused_with_a_suggestion() -> None:
    with pytest.raises(ValueError, match=r"unknown key 'zero_optimisation' in the top level.*'zero_optimization'"):
        validate_config({"zero_optimisation": {"stage": 2}, "zero_optimization": {"stage": 2}})


def test_misplaced_zero_key_at_top_level_is_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown key 'overlap_comm' in the top level"):
        ZeroStrategy(stage=2, config={"overlap_comm": False})


def test_unknown_zero_and_offload_keys_are_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown key 'reduce_bucket' in zero_optimization.*'reduce_bucket_size'"):
        ZeroStrategy(stage=2, config={"zero_optimization": {"reduce_bucket": 10}})
    with pytest.raises(ValueError, match=r"unknown key 'pinned' in zero_optimization.offload_optimizer"):
        validate_config({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pinned": 1}}})


def test_stage_and_stage3_incompatibilities() -> None:
    with pytest.raises(ValueError, match=r"ZeroStrategy\(stage=0\): stage must be one of \(1, 2, 3\), got 0; "
                                         r"for no sharding use Trainer\(strategy='ddp'\)"):
        ZeroStrategy(stage=0)
    with pytest.raises(ValueError, match=r"offload_parameters=True needs stage=3.*got stage=2.*zero3_offload"):
        ZeroStrategy(stage=2, offload_parameters=True)
    with pytest.raises(ValueError, match=r"\['stage3_max_live_parameters'\] only apply at stage 3, got stage=2"):
        ZeroStrategy(stage=2, config={"zero_optimization": {"stage3_max_live_parameters": 10}})
    with pytest.raises(ValueError, match="stage=3 cannot be combined with DeepSpeed pipeline parallelism"):
        ZeroStrategy(stage=3, config={"pipeline": {"stages": 2}})
    with pytest.raises(ValueError, match="stage=3 does not support sparse_gradients=true"):
        ZeroStrategy(stage=3, config={"sparse_gradients": True})
    with pytest.raises(ValueError, match="do not set 'gradient_accumulation_steps'.*accumulation=fixed"):
        ZeroStrategy(config={"gradient_accumulation_steps": 4})


def test_raw_config_is_merged_not_replacing_and_not_mutated() -> None:
    raw = {"zero_optimization": {"reduce_bucket_size": 1234}, "steps_per_print": 7}
    strategy = ZeroStrategy(stage=1, overlap_comm=False, config=raw)
    zero = strategy.config["zero_optimization"]
    assert (zero["stage"], zero["reduce_bucket_size"], zero["overlap_comm"]) == (1, 1234, False)
    assert strategy.config["steps_per_print"] == 7
    assert raw == {"zero_optimization": {"reduce_bucket_size": 1234}, "steps_per_print": 7}
    assert merge_config({"a": {"b": 1, "c": 2}}, {"a": {"b": 3}}) == {"a": {"b": 3, "c": 2}}


def test_raw_config_path_must_exist(tmp_path) -> None:
    with pytest.raises(ValueError, match="config=...\\) path does not exist"):
        ZeroStrategy(config=str(tmp_path / "missing.json"))
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 3}}')
    assert ZeroStrategy(stage=1, config=str(path)).stage == 3


def test_offload_needs_a_cpu_optimizer() -> None:
    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    with pytest.raises(ValueError, match=r"offload_optimizer=True needs .*got AdamW.*DeepSpeedCPUAdam.*optimizer=cpu_adam"):
        check_offload_optimizer(adamw, offload=True)
    check_offload_optimizer(adamw, offload=False)  # no offload: any optimizer


def test_precision_checks() -> None:
    with pytest.raises(ValueError, match=r"precision='16-mixed' is not supported by DeepSpeed on the CPU accelerator"):
        check_precision("16-mixed", "cpu")
    check_precision("16-mixed", "cuda")
    check_precision("bf16-mixed", "cpu")
    with pytest.raises(ValueError, match="precision must be one of"):
        check_precision("64-true", "cpu")


def test_fp16_section_from_a_gradscaler_config() -> None:
    section = fp16_section({"init_scale": 2.0 ** 10, "growth_interval": 200, "min_scale": 4.0})
    assert section == {"enabled": True, "loss_scale": 0, "initial_scale_power": 10, "loss_scale_window": 200,
                       "hysteresis": 1, "min_loss_scale": 4.0}
    with pytest.raises(ValueError, match="init_scale must be a power of two"):
        fp16_section({"init_scale": 1000.0})
    with pytest.raises(ValueError, match="growth_factor/backoff_factor must be 2.0/0.5"):
        fp16_section({"growth_factor": 3.0})


# -- precision plugins are converted (the GuardedPrecision interface is duck-typed) --------------------------
def _guarded(precision: str, on_nonfinite: str | None = "skip", **scaler: float):
    # the agreed interface of lit_speed.GuardedPrecision, as plain attributes
    return SimpleNamespace(precision=precision, mode="mixed", on_nonfinite=on_nonfinite,
                           scaler_config={"init_scale": 2.0 ** 12, "growth_interval": 50, **scaler})


def test_a_precision_plugin_is_replaced_by_deepspeeds() -> None:
    from lightning.pytorch.plugins.precision import DeepSpeedPrecision, MixedPrecision

    strategy = ZeroStrategy(stage=2)
    strategy.precision_plugin = MixedPrecision("bf16-mixed", "cpu")
    assert isinstance(strategy.precision_plugin, DeepSpeedPrecision)
    assert strategy.precision_plugin.precision == "bf16-mixed"
    with pytest.raises(ValueError, match=r"precision plugin whose .precision is one of .* got SimpleNamespace"):
        strategy.precision_plugin = SimpleNamespace(precision="fp8")


def test_fp16_takes_the_scaler_config_and_refuses_other_nonfinite_policies() -> None:
    strategy = ZeroStrategy(stage=2)
    strategy.precision_plugin = _guarded("16-mixed")
    strategy._apply_source_precision()
    assert strategy.config["fp16"]["initial_scale_power"] == 12
    assert strategy.config["fp16"]["loss_scale_window"] == 50
    strategy = ZeroStrategy(stage=2)
    strategy.precision_plugin = _guarded("16-mixed", on_nonfinite="raise")
    with pytest.raises(ValueError, match=r"on_nonfinite='raise' cannot be honoured .* set on_nonfinite='skip'"):
        strategy._apply_source_precision()


def test_bf16_skip_is_honoured_and_other_policies_warn_that_steps_are_skipped_instead() -> None:
    # issue 16 item 4: 'skip' is honoured under ZeRO in every mode (GuardedDeepSpeedPrecision), silently
    from lit_speed.precision.zero_guard import GuardedDeepSpeedPrecision

    strategy = ZeroStrategy(stage=2)
    strategy.precision_plugin = _guarded("bf16-mixed", on_nonfinite="skip")
    assert isinstance(strategy.precision_plugin, GuardedDeepSpeedPrecision)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy._apply_source_precision()
    strategy = ZeroStrategy(stage=2)
    strategy.precision_plugin = _guarded("bf16-mixed", on_nonfinite="fallback")
    with pytest.warns(UserWarning, match=r"on_nonfinite='fallback' is not applied under ZeroStrategy.*skipped instead"):
        strategy._apply_source_precision()
    assert "fp16" not in strategy.config and "bf16" not in strategy.config  # bf16 is set by Lightning later
    strategy = ZeroStrategy(stage=2)
    strategy.precision_plugin = _guarded("32-true", on_nonfinite=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy._apply_source_precision()


def test_describe_rows_without_and_with_a_model() -> None:
    strategy = ZeroStrategy(stage=3, offload_optimizer=True, offload_parameters=True)
    rows = strategy.describe()
    assert rows["zero"].startswith("stage 3, offload: optimizer, parameters, 1 rank(s)")
    assert "bytes/param" in rows["zero model states / rank"]
    model = torch.nn.Linear(1000, 1000)  # 1,001,000 parameters, fp32: 16 bytes each without sharding
    rows = strategy.describe(model)["zero model states / rank"]
    assert "= 15.3 MiB" in rows and "DDP: 15.3 MiB" in rows  # one rank: ZeRO shards nothing


def test_describe_counts_a_frozen_base_in_the_parameters_every_rank_holds() -> None:
    # issue 33: under adapters the row counted the trainable parameters only (292 KiB of a 3.8 MiB model)
    strategy = ZeroStrategy(stage=2)
    model = torch.nn.Linear(1000, 1000)
    model.weight.requires_grad_(False)  # 1,000,000 frozen, 1,000 trainable
    row = strategy.describe(model)["zero model states / rank"]
    assert row.startswith("1,000 trainable + 1,000,000 frozen parameters: params 3.8 MiB + grads 3.9 KiB + "), row
