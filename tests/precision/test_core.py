"""GuardedPrecision's functional core: modes, auto choice, chains, compatibility, probe, guard, fp32 islands.

No Trainer here: every rule is exercised with given inputs, so nothing depends on this machine's CPU or GPU.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lit_speed import GuardedPrecision
from lit_speed.precision import guarded_precision, modes
from lit_speed.precision.fp32_modules import Float32Islands, match_modules
from lit_speed.precision.nonfinite import Action, GuardCounters, all_finite, decide, first_nonfinite, is_genuine
from lit_speed.precision.probe import measure_slowdown, slowdown_ratio, slowdown_warning
from lit_speed.precision.skip_aware_scheduler import SkipAwareScheduler, unwrap


# ---- modes and validation -----------------------------------------------------------------------------------
def test_unknown_mode_names_the_setting_and_choices() -> None:
    with pytest.raises(ValueError, match=r"GuardedPrecision\(mode='fp8'\): mode must be one of 32-true, bf16-mixed, "
                                         r"16-mixed, bf16-true, bf16-master, "
                                         r"auto; got 'fp8'"):
        GuardedPrecision("fp8")


@pytest.mark.parametrize("kwargs, match", [
    ({"on_nonfinite": "ignore"},
     r"GuardedPrecision\(on_nonfinite='ignore'\): on_nonfinite must be one of skip, fallback, raise; got 'ignore'"),
    ({"mode": "bf16-true", "on_nonfinite": "fallback"}, r"'fallback' needs a mixed mode"),
    ({"mode": "16-mixed", "fallback_chain": ["16-mixed"]}, r"without the starting mode '16-mixed'"),
    ({"mode": "16-mixed", "fallback_chain": ["bf16-true"]}, r"fallback_chain must list distinct modes"),
    ({"fallback_after": 0}, r"GuardedPrecision\(fallback_after=0\): fallback_after must be an int >= 1, got 0"),
    ({"backoff_factor": 1.5}, r"0 < backoff_factor < 1.*backoff_factor=1.5"),
    ({"min_scale": 0.0}, r"0 < min_scale <= init_scale.*min_scale=0.0"),
    ({"matmul_precision": "tf32"}, r"matmul_precision must be 'highest', 'high', 'medium' or None; got 'tf32'"),
])
def test_bad_settings_are_refused_at_construction(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GuardedPrecision(**kwargs)


def test_default_policy_is_fallback_except_for_bf16_true() -> None:
    assert GuardedPrecision("16-mixed").on_nonfinite == "fallback"
    assert GuardedPrecision("bf16-true").on_nonfinite == "skip"


@pytest.mark.parametrize("device, cuda_bf16, cpu_bf16, slowdown, expected", [
    ("cuda", True, False, None, "bf16-mixed"),
    ("cuda", False, False, None, "16-mixed"),
    ("cpu", False, False, None, "32-true"),
    ("cpu", False, True, 57.0, "32-true"),   # the AVX2 EPYC's emulated bf16, as measured (MEASUREMENTS.md)
    ("cpu", False, True, 0.3, "bf16-mixed"),  # an AMX Xeon's native bf16
])
def test_auto_picks_the_fastest_safe_mode_and_says_why(device, cuda_bf16, cpu_bf16, slowdown, expected) -> None:
    mode, reason = modes.choose_auto_mode(device, cuda_bf16, cpu_bf16, slowdown, max_slowdown=2.0)
    assert mode == expected
    assert reason and (slowdown is None or slowdown <= 2.0 or f"{slowdown:.1f}x" in reason)


def test_bf16_on_a_cuda_device_without_bf16_is_refused() -> None:
    with pytest.raises(ValueError, match=r"GuardedPrecision\(mode='bf16-mixed'\): mode='bf16-mixed' needs bf16 "
                                         r"support.*mode='16-mixed'"):
        modes.check_device_support("bf16-mixed", "cuda", cuda_bf16=False)
    modes.check_device_support("16-mixed", "cuda", cuda_bf16=False)  # fp16 is fine there
    with pytest.raises(ValueError, match=r"GuardedPrecision runs on cpu or cuda; the trainer's device is 'mps'"):
        modes.check_device_support("32-true", "mps", cuda_bf16=False)


def test_default_fallback_chain_skips_bf16_where_unsupported() -> None:
    assert modes.default_chain("16-mixed") == ["bf16-mixed", "32-true"]
    assert modes.default_chain("16-mixed", bf16_ok=False) == ["32-true"]
    assert modes.default_chain("bf16-mixed") == ["32-true"]
    assert modes.default_chain("32-true") == [] and modes.default_chain("bf16-true") == []


def test_a_deepspeed_strategy_that_did_not_take_precision_over_is_refused() -> None:
    from lightning.pytorch.strategies import DeepSpeedStrategy

    with pytest.raises(ValueError, match=r"installed under DeepSpeedStrategy, which did not take precision over.*"
                                         r"ZeroStrategy\(stage=1\|2\|3\)"):
        modes.check_strategy("bf16-mixed", DeepSpeedStrategy())


def test_fp16_with_a_strategy_that_cannot_scale_the_loss_is_refused() -> None:
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    with pytest.raises(ValueError, match=r"GuardedPrecision\(mode='16-mixed'\): mode='16-mixed' needs loss scaling, "
                                         r"which GuardedPrecision cannot do under FSDPStrategy.*mode='bf16-mixed'"):
        modes.check_strategy("16-mixed", FSDPStrategy())
    modes.check_strategy("bf16-mixed", FSDPStrategy())  # no scaler needed
    modes.check_strategy("16-mixed", DDPStrategy())     # plain DDP: the local GradScaler is correct


# ---- CPU slowness probe -------------------------------------------------------------------------------------
def test_slowness_warning_is_a_pure_function_of_the_timings() -> None:
    ratio = slowdown_ratio(fp32_seconds=0.001, low_seconds=0.057)
    assert ratio == pytest.approx(57.0)
    message = slowdown_warning(torch.bfloat16, ratio, threshold=2.0)
    assert message is not None and "bfloat16 matmul on this CPU measured 57.0x slower than float32" in message
    assert "precision=32-true" in message
    assert slowdown_warning(torch.bfloat16, 1.9, threshold=2.0) is None
    with pytest.raises(ValueError, match="timings must be > 0 seconds"):
        slowdown_ratio(0.0, 1.0)


def test_probe_measures_once_per_process() -> None:
    first = measure_slowdown(torch.bfloat16)
    assert first > 0 and measure_slowdown(torch.bfloat16) == first  # cached, not re-timed


def test_plugin_warns_once_when_the_probe_exceeds_its_threshold() -> None:
    # a threshold of 0 makes any measured ratio "too slow": the wiring is tested on any CPU
    guarded_precision._WARNED_SLOW.discard(torch.bfloat16)
    plugin = GuardedPrecision("bf16-mixed", max_cpu_slowdown=0.0)
    with pytest.warns(UserWarning, match=r"bfloat16 matmul on this CPU measured .*x slower than float32"):
        plugin._warn_if_slow(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plugin._warn_if_slow(torch.bfloat16)  # once per process
    guarded_precision._WARNED_SLOW.discard(torch.bfloat16)


# ---- non-finite guard ---------------------------------------------------------------------------------------
def test_all_finite_and_first_nonfinite() -> None:
    ok, bad = torch.ones(3), torch.tensor([1.0, float("nan")])
    assert bool(all_finite([ok, ok])) and not bool(all_finite([ok, bad]))
    assert first_nonfinite([("a", ok), ("b", bad)]) == "b (nan)"
    assert first_nonfinite([("c", torch.tensor([float("inf")]))]) == "c (inf)"


def test_only_overflows_the_scaler_cannot_fix_are_genuine() -> None:
    assert not is_genuine(loss_finite=True, grads_finite=False, scale=1024.0, min_scale=1.0)  # scaler backs off
    assert is_genuine(loss_finite=True, grads_finite=False, scale=1.0, min_scale=1.0)         # at the floor
    assert is_genuine(loss_finite=True, grads_finite=False, scale=None, min_scale=1.0)        # no scaler
    assert is_genuine(loss_finite=False, grads_finite=False, scale=1024.0, min_scale=1.0)     # a NaN loss


def test_fallback_after_n_consecutive_genuine_bad_steps() -> None:
    c = GuardCounters()
    actions = [decide(c, bad, True, "fallback", 3, has_next_mode=True) for bad in (True, True, False, True, True)]
    assert actions == [Action.SKIP, Action.SKIP, Action.STEP, Action.SKIP, Action.SKIP]  # a clean step resets
    assert decide(c, True, True, "fallback", 3, has_next_mode=True) is Action.FALLBACK
    assert (c.attempted_steps, c.skipped_steps) == (6, 5)
    assert c.nonfinite_rate == pytest.approx(5 / 6)
    assert decide(GuardCounters(consecutive_bad=2), True, True, "fallback", 3, False) is Action.RAISE  # chain empty
    assert decide(GuardCounters(), True, True, "raise", 3, True) is Action.RAISE
    assert decide(GuardCounters(), True, False, "raise", 3, True) is Action.SKIP  # the scaler's own business
    assert decide(GuardCounters(consecutive_bad=9), True, True, "skip", 3, True) is Action.SKIP


def test_counters_round_trip_and_read_missing_keys_as_defaults() -> None:
    c = GuardCounters(4, 2, 1, [{"step": 3, "from": "16-mixed", "to": "bf16-mixed", "reason": "loss=nan"}])
    restored = GuardCounters()
    restored.load_state_dict(c.state_dict())
    assert restored == c
    restored.load_state_dict({"skipped_steps": 7})  # an older checkpoint without the other keys
    assert (restored.attempted_steps, restored.skipped_steps, restored.fallbacks) == (0, 7, [])


# ---- fp32 modules -------------------------------------------------------------------------------------------
class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.fc1(x)
        n = self.norm(h)
        logits = self.fc2(n)
        return {"h": h, "norm": n, "logits": logits, "loss": self.loss(logits, torch.zeros(len(x), dtype=torch.long))}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_modules_run_in_float32_and_the_rest_in_low_precision(dtype: torch.dtype) -> None:
    net = _Net()
    islands = Float32Islands("cpu")
    islands.install(match_modules(net, ["LayerNorm", "fc2", "loss"]))  # class names and module names
    with torch.autocast("cpu", dtype=dtype):
        out = net(torch.randn(4, 8))
    assert {k: v.dtype for k, v in out.items()} == {"h": dtype, "norm": torch.float32, "logits": torch.float32,
                                                      "loss": torch.float32}
    islands.remove()  # without the hooks the same Linear runs in the low precision
    with torch.autocast("cpu", dtype=dtype):
        assert net(torch.randn(4, 8))["logits"].dtype == dtype


def test_fp32_modules_islands_survive_an_exception_inside_the_module() -> None:
    net = nn.Sequential(nn.Linear(2, 2))
    islands = Float32Islands("cpu")
    islands.install(match_modules(net, [nn.Linear]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError):
            net(torch.randn(3, 5))  # wrong width: the forward raises
        assert torch.is_autocast_enabled("cpu")  # the disabled-autocast context was closed again


def test_fp32_modules_entry_that_matches_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match=r"fp32_modules entry 'BatchNorm' matches no module of _Net.*LayerNorm"):
        match_modules(_Net(), ["BatchNorm"])


# ---- LR scheduler wrapper -----------------------------------------------------------------------------------
def test_scheduler_does_not_step_after_a_skipped_optimizer_step() -> None:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    inner = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    skipped = [False]
    sched = SkipAwareScheduler(inner, lambda: skipped[0])
    opt.step()
    sched.step()
    skipped[0] = True
    sched.step()
    assert inner.last_epoch == 1 and sched.held_steps == 1 and sched.get_last_lr() == [0.5]
    assert sched.state_dict() == inner.state_dict() and sched.optimizer is opt and unwrap(sched) is inner


def test_the_mode_list_in_the_docstring_and_the_option_files_are_the_mode_table() -> None:
    """GuardedPrecision's ``mode:`` line and ``conf/precision/`` name exactly ``modes.MODES`` (issue 34)."""
    import re

    from lit_speed.precision import GuardedPrecision
    from lit_speed.precision.modes import MODES
    from tests.helpers.repo import CONF

    doc = GuardedPrecision.__doc__.split("mode:", 1)[1].split("(", 1)[0]
    assert set(re.findall(r"``([\w-]+)``", doc)) == set(MODES)
    assert {p.stem for p in (CONF / "precision").glob("*.yaml")} == set(MODES)


@pytest.mark.parametrize(("classes", "processes", "refused"), [
    (["DDPStrategy", "ParallelStrategy"], None, True), (["SingleDeviceStrategy"], 1, False),
    (["SingleDeviceStrategy"], 2, True), (["ZeroStrategy", "DeepSpeedStrategy", "DDPStrategy"], 4, False),
    (["FSDPStrategy"], 1, True)])
def test_one_rule_says_where_a_one_process_mode_cannot_run(classes, processes, refused) -> None:
    """``modes.refused_processes``: the rule GuardedPrecision and the runner's config check both ask (issue 34)."""
    from lit_speed.precision.modes import refused_processes

    assert refused_processes("bf16-master", classes, processes) is refused
    assert refused_processes("bf16-mixed", classes, processes) is False
