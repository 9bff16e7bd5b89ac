"""The step trace that tells a resume bug from a machine that does not repeat a computation
(``tests/helpers/fault_scripts/trace_steps.py``, used by the resume matrix when a resumed run differs)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.fault_scripts.trace_steps import (
    INPUTS,
    OUTPUTS,
    digest,
    first_divergence,
    judge_differing_resume,
    read_trace,
)


def test_digest_sees_one_ulp_the_dtype_and_strings_but_not_reasons() -> None:
    x = torch.linspace(-1, 1, 33)
    nudged = x.clone()
    nudged[7] = torch.nextafter(nudged[7], torch.tensor(2.0))
    assert digest({"w": x}) == digest({"w": x.clone()})
    assert digest({"w": x}) != digest({"w": nudged})
    bits = torch.arange(8, dtype=torch.int16)
    assert digest(bits) != digest(bits.view(torch.bfloat16))  # the same bytes read as another dtype
    assert digest({"mode": "bf16-mixed"}) != digest({"mode": "32-true"})
    assert digest({"mode": "bf16-mixed", "reason": "timed"}) == digest(
        {"mode": "bf16-mixed", "reason": "restored from the checkpoint (not timed again)"})


def _record(pid: int, batch_idx: int, step: int, loss: str = "l", **changed: str) -> dict:
    inputs = {k: changed.get(k, f"{k}@{batch_idx}") for k in INPUTS}
    outputs = {k: changed.get(f"out_{k}", f"{k}>{batch_idx}") for k in OUTPUTS}
    return {"pid": pid, "epoch": 0, "batch_idx": batch_idx, "step": step, "in": inputs,
            "loss": [f"{loss}{batch_idx}"], "loss_value": [0.5], "out": outputs}


TWIN = [_record(3, i, i) for i in range(6)]
STOPPED = [_record(1, i, i) for i in range(4)]
RESUMED = [_record(2, i, i) for i in range(3, 6)]


def test_a_resume_that_matches_batch_for_batch_has_no_divergence() -> None:
    assert first_divergence(STOPPED, RESUMED, TWIN) is None


@pytest.mark.parametrize("field", INPUTS)
def test_an_input_the_resume_restored_differently_is_named(field: str) -> None:
    resumed = [RESUMED[0], _record(2, 4, 4, **{field: "other"}), RESUMED[2]]
    kind, where = first_divergence(STOPPED, resumed, TWIN)
    assert kind == "resume"
    assert "resumed run's epoch 0 batch 4 (step 4)" in where and where.endswith(f"differ from the twin's: {field}")


def test_a_step_counter_the_resume_restored_differently_is_named() -> None:
    kind, where = first_divergence(STOPPED, [_record(2, 3, 4), *RESUMED[1:]], TWIN)
    assert (kind, "the step counter (4 vs 3)" in where) == ("resume", True)


def test_equal_inputs_with_another_loss_or_result_are_the_machine() -> None:
    kind, where = first_divergence(STOPPED, [_record(2, 3, 3, loss="x"), *RESUMED[1:]], TWIN)
    assert kind == "machine" and "loss is not" in where and "same forward computed differently" in where
    kind, where = first_divergence(STOPPED, [_record(2, 3, 3, out_precision="skipped"), *RESUMED[1:]], TWIN)
    assert kind == "machine" and "the precision after the batch are not" in where


def test_a_stopped_run_that_parts_from_its_twin_before_the_stop_is_not_called_a_resume_bug() -> None:
    stopped = [*STOPPED[:2], _record(1, 2, 2, weights="other"), STOPPED[3]]
    kind, where = first_divergence(stopped, RESUMED, TWIN)
    assert kind == "machine" and where.startswith("at the stopped run's epoch 0 batch 2")


def test_a_batch_the_twin_never_trained_or_no_batch_at_all_fails() -> None:
    with pytest.raises(AssertionError, match="never reached"):
        first_divergence(STOPPED, [*RESUMED, _record(2, 6, 6)], TWIN)
    with pytest.raises(AssertionError, match="traced no training batch"):
        first_divergence(STOPPED, [], TWIN)


def test_read_trace_splits_the_file_by_process(tmp_path: Path) -> None:
    import json

    path = tmp_path / "run.trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [*STOPPED, *RESUMED]))
    assert read_trace(path) == [STOPPED, RESUMED]


@pytest.mark.parametrize("verdict", ["none", "resume", "machine"])
def test_a_differing_resume_fails_or_skips_as_its_trace_says(tmp_path: Path, verdict: str) -> None:
    """The traces' three outcomes, without training: an input the resume restored differently fails naming it, equal
    inputs with another loss skip naming the machine and the batch, traces that agree leave it to the controls."""
    import json

    resumed = {"none": RESUMED, "resume": [_record(2, 3, 3, torch_rng="other"), *RESUMED[1:]],
               "machine": [_record(2, 3, 3, loss="x"), *RESUMED[1:]]}[verdict]
    for name, records in (("run", [*STOPPED, *resumed]), ("reference", TWIN)):
        (tmp_path / f"{name}.trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    difference = AssertionError("18/24 tensors differ from the uninterrupted run")
    if verdict == "none":
        assert judge_differing_resume(tmp_path / "run", tmp_path / "reference", difference) is None
    elif verdict == "resume":
        with pytest.raises(AssertionError, match=r"18/24 .*restored something else: at the resumed run's epoch 0 "
                                                 r"batch 3 .*: torch_rng"):
            judge_differing_resume(tmp_path / "run", tmp_path / "reference", difference)
    else:
        with pytest.raises(pytest.skip.Exception, match=r"does not repeat the run bit for bit: at the resumed run's "
                                                        r"epoch 0 batch 3 .*loss is not .*cannot be judged .*18/24"):
            judge_differing_resume(tmp_path / "run", tmp_path / "reference", difference)


@pytest.mark.slow
def test_the_trace_names_the_rng_of_a_resume_that_does_not_restore_it(tmp_path: Path) -> None:
    """A real resume bug, made on purpose: the resumed run does not restore the RNG states (FaultTolerance's
    ``restore_rng=false``), so the MLP's dropout draws other masks. The trace names the RNG at the first batch after
    the resume; a proper resume of the same stopped run traces batch for batch like the twin."""
    import shutil

    from tests.checkpointing.test_resume_matrix import DIGITS
    from tests.helpers.fault_scripts.runs import explain, kill_at, train, train_side_by_side
    from tests.helpers.fault_scripts.trace_steps import traced

    stopped = train(traced(DIGITS + kill_at(13), tmp_path / "run"), tmp_path / "run")
    assert stopped.returncode == -9, explain(stopped)
    shutil.copytree(tmp_path / "run", tmp_path / "unrestored")
    shutil.copy(tmp_path / "run.trace.jsonl", tmp_path / "unrestored.trace.jsonl")
    resume = DIGITS + ["ckpt_path=last"]
    jobs = [(traced(resume, tmp_path / "run"), tmp_path / "run"),
            (traced(resume + ["callbacks.fault_tolerance.restore_rng=false"], tmp_path / "unrestored"),
             tmp_path / "unrestored"),
            (traced(DIGITS, tmp_path / "reference"), tmp_path / "reference")]
    for done in train_side_by_side(*jobs):
        assert done.returncode == 0, explain(done)
    twin = read_trace(tmp_path / "reference.trace.jsonl")[0]
    assert first_divergence(*read_trace(tmp_path / "run.trace.jsonl"), twin) is None
    kind, where = first_divergence(*read_trace(tmp_path / "unrestored.trace.jsonl"), twin)
    assert kind == "resume" and where.endswith("differ from the twin's: torch_rng"), where
