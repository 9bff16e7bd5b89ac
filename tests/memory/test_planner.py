"""Fit planner: model-state arithmetic, predicted vs measured peaks on the charlm GPT, overrides that run."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import pytest
import torch

from lit_speed.memory.model_state import state_bytes
from lit_speed.memory.planner import Probe, plan, resize_batch
from lit_speed.models.gpt import GPTModule
from tests.helpers.memory import ROOT, TINY_GPT, adamw, charlm_datamodule, measured_fit_peak

P = 1_000_000


def test_state_bytes_follow_the_zero_paper():
    # Adam in fp32: 4 (param) + 4 (grad) + 8 (two states) = 16 bytes per parameter
    assert state_bytes(P, "32-true", 2).device == 16 * P
    # bf16-true keeps everything in 2-byte elements
    assert state_bytes(P, "bf16-true", 2).device == 8 * P
    # mixed precision ZeRO: 2P params + 2P grads + K=12 optimizer bytes (fp32 master + 2 states), partitioned
    n = 4
    assert state_bytes(P, "bf16-mixed", 2, "zero1", n).device == 2 * P + 2 * P + 12 * P // n
    assert state_bytes(P, "bf16-mixed", 2, "zero2", n).device == 2 * P + 2 * P // n + 12 * P // n
    assert state_bytes(P, "bf16-mixed", 2, "zero3", n).device == (2 + 2 + 12) * P // n
    offload = state_bytes(P, "bf16-mixed", 2, "zero2_offload", n)
    assert (offload.device, offload.host) == (2 * P + 2 * P // n, 12 * P // n)
    assert state_bytes(P, "32-true", 1).optimizer == 4 * P  # SGD momentum / Lion: one state


def test_state_bytes_errors():
    with pytest.raises(ValueError, match=r"precision must be one of .*got 'fp8'"):
        state_bytes(P, "fp8")
    with pytest.raises(ValueError, match=r"strategy must be one of .*got 'zero4'"):
        state_bytes(P, "32-true", 2, "zero4")
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        state_bytes(P, "32-true", 2, "auto", 0)


def test_plan_argument_errors():
    model, batch = torch.nn.Linear(4, 4), torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"plan strategies must be a non-empty list from .*got \['zero9'\]"):
        plan(model, batch, strategies=["zero9"])
    # issue 25: the planner asks the optimizer the run builds (a factory), no longer a table of option names
    with pytest.raises(ValueError, match=r"optimizer_factory must be a callable params -> Optimizer.*got 'adam'"):
        plan(model, batch, optimizer_factory="adam")
    with pytest.raises(ValueError, match="probe_batches must be two increasing sizes"):
        plan(model, batch, probe_batches=(4, 2))


def test_resize_batch_tiles_and_cuts():
    x = torch.arange(6).view(3, 2)
    assert resize_batch((x, x), 2)[0].tolist() == [[0, 1], [2, 3]]
    assert resize_batch({"x": x}, 5)["x"][:, 0].tolist() == [0, 2, 4, 0, 2]


def test_speed_fit_survives_noisy_timings():
    noisy = Probe(bytes_fit=(0.0, 1.0), seconds_fit=(-0.5, 0.3))  # negative intercept: noise
    assert noisy.samples_per_sec(8) == pytest.approx(8 / (8 * (0.1 / 2)))


def _charlm_plan(precisions, micro_batches):
    dm = charlm_datamodule(8)
    dm.setup()
    torch.manual_seed(0)
    model = GPTModule(**TINY_GPT, optimizer=adamw)
    return plan(model, next(iter(dm.train_dataloader())), micro_batches=micro_batches, precisions=precisions,
                optimizer_factory=adamw, base_overrides=["experiment=charlm_cpu"], probe_batches=(2, 4))


def _assert_within(rows, tmp_path, tolerance=0.15):
    report = []
    for row in rows:
        measured = measured_fit_peak(row.precision, row.checkpointing, row.micro_batch, tmp_path)
        report.append((row.precision, row.checkpointing, row.micro_batch, row.peak_bytes, measured))
    for precision, ckpt, micro, predicted, measured in report:
        assert abs(predicted - measured) <= tolerance * measured, report
    return report


def test_predicted_peak_matches_measured_fp32(tmp_path):
    # probes at micro-batch 2 and 4, predictions extrapolated to 12 (the experiment's size)
    result = _charlm_plan(["32-true"], [12])
    assert len(result.rows) == 2
    report = _assert_within(result.rows, tmp_path)
    peaks = {ckpt: measured for _, ckpt, _, _, measured in report}
    assert peaks[True] < peaks[False]


@pytest.mark.slow
def test_predicted_peak_within_15_percent_for_eight_charlm_configs(tmp_path):
    result = _charlm_plan(["32-true", "bf16-mixed"], [8, 24])
    assert len(result.rows) == 8  # 2 precisions x checkpointing on/off x 2 micro-batches
    _assert_within(result.rows, tmp_path)


def _run_train(command: str, tmp_path) -> subprocess.CompletedProcess:
    args = shlex.split(command)
    assert args[:2] == ["python", "scripts/train.py"]
    return subprocess.run([sys.executable, *args[1:], "debug=fast", "logger=none", f"hydra.run.dir={tmp_path}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_a_rows_overrides_run_as_printed(tmp_path):
    result = _charlm_plan(["32-true"], [4])
    row = next(r for r in result.rows if r.checkpointing)
    assert "'callbacks=[default,activation_checkpointing]'" in row.command
    done = _run_train(row.command, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["components"]["ActivationCheckpointing"]["wrapped_modules"] == TINY_GPT["n_layer"]
    assert summary["config"]["data"]["batch_size"] == row.micro_batch


@pytest.mark.slow
def test_plan_script_prints_runnable_commands(tmp_path):
    out = subprocess.run([sys.executable, "scripts/plan.py", "experiment=charlm_cpu", "--budget-mib", "64",
                          "--micro-batches", "4,8", "--precisions", "32-true"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    commands = re.findall(r"^#\d+: (python scripts/train.py .*)$", out.stdout, flags=re.M)
    assert len(commands) == 4
    done = _run_train(commands[0], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]


def _plan_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("plan_script", ROOT / "scripts" / "plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv, message", [
    (["--micro-batches", "4,x"], r"--micro-batches must be comma-separated positive integers, got '4,x'"),
    (["data=charlmm"], r"Config error: data=charlmm: unknown option 'charlmm'.*Did you mean data=charlm\?"),
    (["experiment"], r"Unknown argument\(s\) \['experiment'\]: give Hydra overrides as key=value"),
    (["--json", "/nonexistent/plan.json"], r"--json /nonexistent/plan\.json: its folder /nonexistent does not exist "
                                            r"or is not writable"),
])
def test_plan_script_refuses_bad_arguments(capsys, argv, message):
    assert _plan_script().main(argv) == 2
    assert re.search(message, capsys.readouterr().err)


def test_the_strategy_layouts_are_the_options_in_conf_strategy(make_cfg) -> None:
    """The calculator's and the planner's strategy tables name exactly ``conf/strategy/``'s options, each with the
    stage and offloads its composed node sets (issue 34: lists that cannot go stale)."""
    from lit_speed.memory.model_state import STRATEGIES, ZeroLayout
    from lit_speed.memory.planner import STRATEGY_SPEED
    from tests.helpers.repo import CONF

    options = {p.stem for p in (CONF / "strategy").glob("*.yaml")}
    assert set(STRATEGIES) == options == set(STRATEGY_SPEED)
    for option in sorted(options):
        node = make_cfg([f"strategy={option}"]).get("strategy")
        if node is None or not str(node.get("_target_", "")).endswith("ZeroStrategy"):
            assert STRATEGIES[option] == ZeroLayout(), option
            continue
        expected = ZeroLayout(node.stage, node.offload_optimizer, node.offload_parameters, deepspeed=True)
        assert STRATEGIES[option] == expected, option
