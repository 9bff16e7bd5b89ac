"""Kill and resume: a run SIGKILLed at a random step and resumed with ``ckpt_path=last`` ends where the
uninterrupted run ends.

What this proves, and what it does not: checkpoints are written at epoch ends (``ModelCheckpoint`` at every
validation), so the resumed run repeats the steps between the last epoch end and the kill. With
``FaultTolerance(restore_rng=True)`` (on by default) those repeated steps draw the same shuffle and dropout,
and the final weights and optimizer state are bitwise equal to the uninterrupted run on CPU with
``trainer.deterministic=true``, on one process and on two (DDP and ZeRO-2: every rank's RNG state is saved).
Without the RNG states they are not
(``test_resume_without_rng_state_is_not_exact``): Lightning checkpoints no RNG state. Mid-epoch checkpoints
of a plain ``DataLoader`` are not exact either (Lightning restarts the epoch's iterator and warns).
"""
from __future__ import annotations

import random
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_speed.checkpointing import FaultTolerance, resolve_ckpt_path, verify_checkpoint  # noqa: E402
from lit_speed.data.digits import DigitsDataModule  # noqa: E402
from lit_speed.models.mlp import MLPClassifier  # noqa: E402
from tests.helpers.fault_scripts.compare_checkpoints import assert_bitwise_equal, max_abs_differences
from tests.helpers.fault_scripts.runs import SHORT_RUN, STEPS_PER_EPOCH, explain, kill_at, train, train_side_by_side
from tests.helpers.fault_scripts.trace_steps import judge_differing_resume, traced

SIGKILLED = -9
TOTAL_STEPS = 3 * STEPS_PER_EPOCH

# (extra overrides, kill range): every case is a deterministic CPU run, so every case must be bitwise exact.
# The kill lands after the first checkpoint (end of epoch 1) and before the last step.
DEFAULT_KILL_RANGE = (STEPS_PER_EPOCH + 1, TOTAL_STEPS - 1)
# ramp 64 -> 128 samples per step at step 4: epoch 1 = 4 steps of 1 micro-batch + 2 of 2 (ends at step 6),
# epochs 2 and 3 = 4 steps each (14 in all)
RAMP = ["accumulation=ramp", "accumulation.factors=null", "accumulation.effective_batch=[[0,64],[4,128]]"]
MATRIX = [
    pytest.param([], DEFAULT_KILL_RANGE, id="32true-auto-noaccum-nocurriculum"),
    pytest.param(["precision=bf16-mixed"], DEFAULT_KILL_RANGE, id="bf16mixed-auto-noaccum-nocurriculum",
                 marks=pytest.mark.slow),
    pytest.param(["strategy=zero2"], DEFAULT_KILL_RANGE, id="32true-zero2-noaccum-nocurriculum",
                 marks=pytest.mark.slow),
    pytest.param(RAMP, (7, 13), id="32true-auto-ramp-nocurriculum", marks=pytest.mark.slow),
    pytest.param(["data=digits_curriculum"], DEFAULT_KILL_RANGE, id="32true-auto-noaccum-curriculum",
                 marks=pytest.mark.slow),
    pytest.param(["precision=bf16-mixed", "strategy=zero2", *RAMP, "data=digits_curriculum"], (7, 13),
                 id="bf16mixed-zero2-ramp-curriculum",
                 marks=pytest.mark.slow),
    # two processes: each rank's RNG state is saved, and the first resumed epoch is re-drawn after set_epoch
    pytest.param(["trainer=ddp_cpu"], DEFAULT_KILL_RANGE, id="32true-ddp2-noaccum-nocurriculum",
                 marks=pytest.mark.slow),
    pytest.param(["trainer=ddp_cpu", "strategy=zero2"], DEFAULT_KILL_RANGE, id="32true-zero2x2-noaccum-nocurriculum",
                 marks=pytest.mark.slow),
]


def _kill_step(case_id: str, kill_range: tuple[int, int]) -> int:
    """A random step in ``kill_range``, seeded by the case, so reruns kill at the same step."""
    return random.Random(case_id).randint(*kill_range)


def _assert_same_training_state(reference: Path, resumed: Path) -> None:
    assert_bitwise_equal(reference, resumed)


@pytest.mark.parametrize("extra, kill_range", MATRIX)
def test_sigkill_at_a_random_step_then_resume_matches_the_uninterrupted_run(tmp_path, extra, kill_range, request):
    step = _kill_step(request.node.callspec.id, kill_range)
    args = SHORT_RUN + extra
    # one process, no ZeRO: every run traced step by step, to judge a resume that differs (the trace reads the
    # module's parameters and torch optimizers' state, which ZeRO partitions)
    trace = not any(a.startswith(("strategy=zero", "trainer=ddp")) for a in extra)
    run, ref = tmp_path / "run", tmp_path / "reference"
    with_trace = traced if trace else (lambda a, d: a)
    reference, killed = train_side_by_side((with_trace(args, ref), ref), (with_trace(args + kill_at(step), run), run))
    assert reference.returncode == 0, explain(reference)
    assert killed.returncode == SIGKILLED, explain(killed)
    last = run / "checkpoints" / "last.ckpt"
    verify_checkpoint(last)

    resumed = train(with_trace(args + ["ckpt_path=last"], run), run)
    assert resumed.returncode == 0, explain(resumed)
    assert f"Restored all states from the checkpoint at {last}" in resumed.stdout + resumed.stderr, explain(resumed)
    try:
        _assert_same_training_state(ref / "checkpoints" / "last.ckpt", last)
    except AssertionError as difference:  # FloatSumsDiffer included: rerun once where the traces agree
        if trace:
            judge_differing_resume(run, ref, difference)
        raise


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["strategy=ddp"], ["strategy=zero2"], ["strategy=ddp", "data=digits_curriculum"]],
                         ids=["ddp", "zero2", "ddp-curriculum"])
def test_two_processes_killed_mid_epoch_resume_bitwise(tmp_path, extra):
    # 2 processes, a checkpoint every 2 steps, killed at step 5: last.ckpt is step 4, half-way through epoch 1.
    # Each rank's shard of the resumable order goes on where it stopped (the permutation is DistributedSampler's,
    # seeded with PL_GLOBAL_SEED + epoch, so the ranks agree on it without drawing from their RNG streams)
    args = SHORT_RUN + ["trainer=ddp_cpu", "callbacks.model_checkpoint.every_n_train_steps=2", *extra]
    reference, killed = train_side_by_side((args, tmp_path / "reference"), (args + kill_at(5), tmp_path / "run"))
    assert reference.returncode == 0, explain(reference)
    assert killed.returncode != 0, explain(killed)
    resumed = train(args + ["ckpt_path=last"], tmp_path / "run")
    assert resumed.returncode == 0, explain(resumed)
    output = resumed.stdout + resumed.stderr
    assert "resumed at epoch 0, batch 4" in output and "not exact" not in output, explain(resumed)
    _assert_same_training_state(tmp_path / "reference" / "checkpoints" / "last.ckpt",
                                tmp_path / "run" / "checkpoints" / "last.ckpt")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["auto", "zero2"])
def test_mid_epoch_checkpoint_of_a_resumable_loader_resumes_exactly(tmp_path, strategy):
    # checkpoints every 4 steps; killed at step 14, so last.ckpt is step 12, half-way through epoch 2. The
    # curriculum sampler resumes its epoch; the RNG must go on from the saved state although Lightning builds
    # a new iterator (drawing its base seed) and, under DeepSpeed, builds it before the restore
    args = SHORT_RUN + ["data=digits_curriculum", "callbacks.model_checkpoint.every_n_train_steps=4",
                        f"strategy={strategy}"]
    reference, killed = train_side_by_side((args, tmp_path / "reference"), (args + kill_at(14), tmp_path / "run"))
    assert reference.returncode == 0, explain(reference)
    assert killed.returncode == SIGKILLED, explain(killed)
    resumed = train(args + ["ckpt_path=last"], tmp_path / "run")
    assert resumed.returncode == 0, explain(resumed)
    assert "curriculum resumed at epoch 1, batch 4" in resumed.stdout + resumed.stderr, explain(resumed)
    _assert_same_training_state(tmp_path / "reference" / "checkpoints" / "last.ckpt",
                                tmp_path / "run" / "checkpoints" / "last.ckpt")


@pytest.mark.slow
def test_sigkill_inside_a_checkpoint_save_keeps_the_previous_one_and_resumes_exactly(tmp_path):
    # dies in the epoch-2 save (step 16), after a temporary file is written and before it replaces its target
    # (ModelCheckpoint writes the top-k file first, then last.ckpt): last.ckpt must still be the step-8 one
    reference, killed = train_side_by_side((SHORT_RUN, tmp_path / "reference"),
                              (SHORT_RUN + kill_at(STEPS_PER_EPOCH + 1, mode="before_rename"), tmp_path / "run"))
    assert reference.returncode == 0, explain(reference)
    assert killed.returncode == SIGKILLED, explain(killed)
    folder = tmp_path / "run" / "checkpoints"
    assert list(folder.glob(".*.tmp-*")), "the kill should have left the unfinished temporary file"
    verify_checkpoint(folder / "last.ckpt")
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == STEPS_PER_EPOCH

    resumed = train(SHORT_RUN + ["ckpt_path=last"], tmp_path / "run")
    assert resumed.returncode == 0, explain(resumed)
    assert not list(folder.glob(".*.tmp-*")), "the orphaned temporary file should be cleaned up"
    _assert_same_training_state(tmp_path / "reference" / "checkpoints" / "last.ckpt", folder / "last.ckpt")


@pytest.mark.slow
def test_resume_without_rng_state_is_not_exact(tmp_path):
    # the control that gives the test above its power: Lightning alone does not restore the RNG states
    args = SHORT_RUN + ["callbacks.fault_tolerance.restore_rng=false"]
    reference, killed = train_side_by_side((args, tmp_path / "reference"),
                                           (args + kill_at(STEPS_PER_EPOCH + 3), tmp_path / "run"))
    assert killed.returncode == SIGKILLED, explain(killed)
    resumed = train(args + ["ckpt_path=last"], tmp_path / "run")
    assert resumed.returncode == 0, explain(resumed)
    diffs = max_abs_differences(tmp_path / "reference" / "checkpoints" / "last.ckpt",
                                tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert max(diffs.values()) > 0.0


def _fit(root: Path, max_epochs: int, ckpt_path: str | None = None) -> pl.Trainer:
    pl.seed_everything(3, workers=True)
    model = MLPClassifier(hidden=32, depth=1, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2))
    trainer = pl.Trainer(accelerator="cpu", max_epochs=max_epochs, limit_train_batches=4, limit_val_batches=1,
                         num_sanity_val_steps=0, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, deterministic=True, default_root_dir=root,
                         callbacks=[ModelCheckpoint(dirpath=root / "checkpoints", save_last=True), FaultTolerance()])
    trainer.fit(model, datamodule=DigitsDataModule(batch_size=32), ckpt_path=resolve_ckpt_path(ckpt_path, trainer))
    return trainer


@pytest.mark.parametrize("damage", ["truncate", "bit_flip"])
def test_damaged_last_checkpoint_falls_back_to_the_previous_one_and_still_ends_exactly(tmp_path, damage):
    _fit(tmp_path / "reference", max_epochs=3)
    _fit(tmp_path / "run", max_epochs=2)  # "preempted" after epoch 2: last.ckpt = epoch 2, .prev = epoch 1
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    data = bytearray(last.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    last.write_bytes(bytes(data))
    # the newest top-k copy (same state as last.ckpt) is gone too: only last.ckpt.prev (epoch 1) is left to find
    for path in last.parent.glob("epoch=*.ckpt"):
        path.unlink()

    with pytest.warns(UserWarning, match=r"last\.ckpt is unusable.*Trying the next older checkpoint"):
        with pytest.warns(UserWarning, match=r"Resuming from .*last\.ckpt\.prev"):
            trainer = _fit(tmp_path / "run", max_epochs=3, ckpt_path="last")
    assert trainer.global_step == 3 * 4  # resumed from epoch 1 (.prev), not from scratch, and trained to the end
    _assert_same_training_state(tmp_path / "reference" / "checkpoints" / "last.ckpt", last)
