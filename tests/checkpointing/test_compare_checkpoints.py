"""The bitwise comparison of a resumed run with its uninterrupted twin (tests/helpers/fault_scripts/compare_checkpoints.py)
and the one rerun it asks for: a difference at the scale of float rounding raises ``FloatSumsDiffer``, which
pytest-rerunfailures reruns once (pyproject's ``only_rerun``); every other failure is final."""
from __future__ import annotations

from pathlib import Path

import pytest
import tomllib
import torch

from tests.helpers.fault_scripts.compare_checkpoints import (
    ROUNDING_SHARE,
    FloatSumsDiffer,
    assert_bitwise_equal,
    assert_same_rows,
)
from tests.helpers.repo import ROOT

pytest_plugins = ["pytester"]


def _checkpoint(path: Path, weight: torch.Tensor) -> Path:
    torch.save({"state_dict": {"net.weight": weight, "net.bias": torch.zeros(3)},
                "optimizer_states": [{"state": {0: {"exp_avg": torch.full((3, 4), 1e-3), "step": torch.tensor(7.0)}}}]}, path)
    return path


@pytest.fixture
def weight() -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(0))


def test_equal_checkpoints_pass(tmp_path, weight):
    assert_bitwise_equal(_checkpoint(tmp_path / "a.ckpt", weight), _checkpoint(tmp_path / "b.ckpt", weight.clone()))


def test_a_difference_of_a_few_ulps_is_float_sums(tmp_path, weight):
    nudged = weight.clone()
    nudged[1, 2] = torch.nextafter(nudged[1, 2], torch.tensor(float("inf")))  # one ulp, as a sum in another order
    with pytest.raises(FloatSumsDiffer, match=r"1/4 tensors differ"):
        assert_bitwise_equal(_checkpoint(tmp_path / "a.ckpt", weight), _checkpoint(tmp_path / "b.ckpt", nudged))


def test_a_difference_the_size_of_an_adamw_step_is_a_plain_failure(tmp_path, weight):
    stepped = weight.clone()
    stepped[0, 0] += 1e-3  # one AdamW step at lr=1e-3: a lost or repeated step, another batch or dropout mask
    with pytest.raises(AssertionError) as raised:
        assert_bitwise_equal(_checkpoint(tmp_path / "a.ckpt", weight), _checkpoint(tmp_path / "b.ckpt", stepped))
    assert not isinstance(raised.value, FloatSumsDiffer)
    assert 1e-3 > ROUNDING_SHARE * float(weight.abs().max())


def test_no_tensor_to_compare_is_a_failure(tmp_path):
    torch.save({"state_dict": {}, "optimizer_states": []}, tmp_path / "a.ckpt")
    with pytest.raises(AssertionError, match="no weight or optimizer tensor"):
        assert_bitwise_equal(tmp_path / "a.ckpt", tmp_path / "a.ckpt")


def test_metrics_rows_close_in_value_are_float_sums_and_anything_else_is_not():
    row = (("epoch", "0"), ("step", "7"), ("train/loss", "0.53125"))
    close = (("epoch", "0"), ("step", "7"), ("train/loss", "0.5312501"))
    assert_same_rows([row], [row])
    with pytest.raises(FloatSumsDiffer):
        assert_same_rows([close], [row])
    for other in ([row, row], [(("epoch", "0"), ("step", "8"), ("train/loss", "0.53125"))],
                  [(("epoch", "0"), ("step", "7"), ("train/loss", "0.54"))]):
        with pytest.raises(AssertionError) as raised:
            assert_same_rows(other, [row])
        assert not isinstance(raised.value, FloatSumsDiffer), other


def test_only_float_sums_are_rerun_and_only_once(pytester):
    """pyproject's rerun settings, in a pytest of their own: a FloatSumsDiffer once then a pass is a pass after one
    rerun; FloatSumsDiffer every time fails after one rerun; any other assertion fails without a rerun."""
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert options["only_rerun"] == ["FloatSumsDiffer"] and int(options["reruns"]) == 1
    pytester.makeini(f"[pytest]\nreruns = {options['reruns']}\nonly_rerun = {options['only_rerun'][0]}\n")
    pytester.makepyfile(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from tests.helpers.fault_scripts.compare_checkpoints import FloatSumsDiffer
        calls = {{"once": 0, "always": 0, "other": 0}}

        def test_once():
            calls["once"] += 1
            if calls["once"] == 1:
                raise FloatSumsDiffer("differ")

        def test_always():
            calls["always"] += 1
            raise FloatSumsDiffer("differ")

        def test_other():
            calls["other"] += 1
            assert calls["other"] == 0, "a resume bug"
    """)
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "rerunfailures")
    outcomes = result.parseoutcomes()
    assert (outcomes.get("passed"), outcomes.get("failed"), outcomes.get("rerun")) == (1, 2, 2), outcomes
    result.stdout.fnmatch_lines(["*.py R.RFF *"])  # once: rerun, pass; always: rerun, fail; other: fail
