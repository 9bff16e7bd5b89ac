"""The resume matrix, generated from the config groups: every option a user can select resumes bitwise.

For every shipped ``experiment=`` preset and every ``optimizer=``, ``precision=``, ``accumulation=`` and ``peft=`` option
(read from ``conf/<group>/*.yaml`` when the tests are collected, so an option added tomorrow joins the matrix
without editing this file), a short deterministic CPU run is

- SIGKILLed at an optimizer step just after a mid-epoch checkpoint (checkpoints every 2 optimizer steps), and
- for the options that accumulate gradients, also stopped by SIGTERM *inside* an accumulation window (the
  checkpoint FaultTolerance writes then holds the partial window's gradients),

then resumed with ``ckpt_path=last`` into the same run folder, and its final checkpoint (weights and optimizer
state) must be bitwise equal to an uninterrupted run's. One option varies at a time from the default
(digits + MLP); presets run as shipped, shrunk to a few steps. One process (multi-process resumes:
``test_faults_resume.py``). ``precision=auto`` is compared with an uninterrupted run in the mode it chose (a run
that times its own step may choose differently from another run on a busy machine; that auto's run equals the
chosen mode's run is tested in ``tests/precision/test_step_timing.py``).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.fault_scripts.compare_checkpoints import assert_bitwise_equal
from tests.helpers.fault_scripts.runs import ROOT, explain, kill_at, train, train_side_by_side
from tests.helpers.fault_scripts.trace_steps import judge_differing_resume, traced

CONF = ROOT / "conf"
DEFAULTS = {"optimizer": "adamw", "precision": "32-true", "accumulation": "none", "peft": "none"}
GROUPS = tuple(DEFAULTS)  # init=weights needs a file: its resume is the presets' (experiment=charlm_finetune)

# digits + MLP: 3 epochs of 8 batches, a checkpoint every 2 optimizer steps (mid-epoch), deterministic
DIGITS = ["trainer.max_epochs=3", "trainer.limit_train_batches=8", "trainer.limit_val_batches=2",
          "trainer.num_sanity_val_steps=0", "trainer.deterministic=true", "seed=7",
          "callbacks=[model_checkpoint,fault_tolerance]", "callbacks.model_checkpoint.every_n_train_steps=2",
          "logger=none", "validate=false", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]
# a preset shrunk to 12 optimizer steps on a small corpus, validated (and checkpointed) every few steps
PRESET = ["trainer.max_steps=12", "trainer.val_check_interval=4", "trainer.limit_val_batches=2",
          "trainer.num_sanity_val_steps=0", "trainer.deterministic=true", "seed=7", "data.max_bytes=300000",
          "callbacks=[model_checkpoint,fault_tolerance]", "callbacks.model_checkpoint.every_n_train_steps=2",
          "logger=none", "validate=false", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]
# windows early enough for a few-step run: digits 64 -> 128 samples per step from step 2; presets 12 -> 24 at 4
ACCUMULATION = {"fixed": ["accumulation.factors=[[0,4]]"],
                "ramp": ["accumulation.factors=null", "accumulation.effective_batch=[[0,64],[2,128]]"],
                # the charlm preset's schedule (12 -> 24 at step 200, a step) on digits' batch of 64: 64 -> 128 at 2
                "charlm_fast": ["accumulation.effective_batch=[[0,64],[2,128]]"]}
#: the kill and SIGTERM points of an accumulation option: those of the schedule it runs here
SCHEDULE = {"fixed": "fixed", "ramp": "ramp", "charlm_fast": "ramp"}
PRESET_ACCUMULATION = ["accumulation.effective_batch=[[0,12],[4,24]]"]
# SIGTERM after this many training batches lands inside a window: fixed 4 -> batch 14 is the 2nd of the window
# 13-16; ramp 1,1 then 2 per step -> batch 9 opens the window 9-10; presets 1 x4 then 2 -> batch 7 opens 7-8
MID_WINDOW = {"fixed": 14, "ramp": 9, "preset": 7}
# the shrunk preset for experiment=sft_lora: no corpus to cap, and its chunked loss kept (the preset sets its chunk)
SFT_PRESET = [*(a for a in PRESET if not a.startswith(("data.max_bytes=", "callbacks="))),
              "callbacks=[model_checkpoint,fault_tolerance,chunked_loss]"]
# odd: the checkpoint before it is one step back (fixed: step 2, written at epoch 1's last batch)
KILL_STEP = {"none": 13, "fixed": 4, "ramp": 7, "preset": 7}
# options that are a key or a callback rather than a group option (issue 32's memory levers): name -> overrides
LEVERS = {"peft=lora peft.base_dtype=bf16": DIGITS + ["peft=lora", "peft.base_dtype=bf16"],
          # full training's export of the trained model after fit (ExportModel; auto exports Hugging Face models only)
          "peft.export=true": DIGITS + ["peft.export=true"],
          # the export's dtype (written after fit, never read back by a resume): a bf16 model.pt, the run resumes as any
          "peft=lora peft.export_dtype=bfloat16": DIGITS + ["peft=lora", "peft.export_dtype=bfloat16"],
          # LoRA's up-projection gradient (peft=lora's row above runs up_grad=auto: decided at fit start, kept on resume)
          "peft=lora peft.up_grad=transposed": DIGITS + ["peft=lora", "peft.up_grad=transposed"],
          "peft=lora peft.base_dtype=int8": DIGITS + ["peft=lora", "peft.base_dtype=int8"],
          # peft.base_dtype=auto (the default) under bf16 autocast: the base held in bf16, decided before the weights load
          "peft=lora precision=bf16-mixed": DIGITS + ["peft=lora", "precision=bf16-mixed"],
          "callbacks+=keep_freed_memory": [*DIGITS, "callbacks=[model_checkpoint,fault_tolerance,keep_freed_memory]"],
          "experiment=charlm_cpu callbacks+=chunked_loss": [
              "experiment=charlm_cpu", *[a for a in PRESET if not a.startswith("callbacks=")],
              "callbacks=[model_checkpoint,fault_tolerance,chunked_loss]", "callbacks.chunked_loss.chunk_mib=0.05"],
          # the attention kernel named (charlm_fast's row runs precision.attention=auto: timed, saved, kept on resume)
          "experiment=charlm_cpu precision.attention=math": [
              "experiment=charlm_cpu", *PRESET, "precision=bf16-mixed", "precision.attention=math"],
          # chunk_mib=auto (the default): the chunk decided at fit start is saved, and a resumed run keeps it
          "experiment=charlm_cpu callbacks+=chunked_loss chunk_mib=auto": [
              "experiment=charlm_cpu", *[a for a in PRESET if not a.startswith("callbacks=")],
              "callbacks=[model_checkpoint,fault_tolerance,chunked_loss]", "callbacks.chunked_loss.chunk_mib=auto"],
          # data=sft's two layouts named (the preset's row runs packing=auto: timed, saved, kept on resume)
          "experiment=sft_lora data.packing=true": ["experiment=sft_lora", *SFT_PRESET, "data.packing=true"],
          "experiment=sft_lora data.packing=false": ["experiment=sft_lora", *SFT_PRESET, "data.packing=false"]}


#: rows whose failure is found and not yet explained, each with what is known (non-strict: a pass reads XPASS)
KNOWN_OPEN = {"precision=16-mixed-sigkill": [pytest.mark.xfail(strict=False, reason=(
    "open (2026-12-02): after the slow tier's first 172 tests in one pytest session the resumed run ended 1.146e-4 "
    "(net.0.weight) from its uninterrupted twin, the same difference to the last digit on CI's machine and on an AMX "
    "Xeon, while two more uninterrupted runs equalled the twin; after tests 1-2 and 136-172 two more uninterrupted "
    "runs differed from the first (the control skipped the row). Alone, after tests 1-135, and in 10 isolated runs "
    "(also with AVX2-only kernels, one thread, and the session's leftover environment: OMP_NUM_THREADS, KMP_*) it is "
    "bitwise equal. What a long session changes for the 16-mixed runs it starts is not found yet. On a second AMX "
    "Xeon (stepping 1) it failed in a session of two tests and passed in the next two such sessions"))],
              "precision=bf16-mixed-sigkill": [pytest.mark.xfail(strict=False, reason=(
                  "open (2026-12-02): CI's slow tier (AMX Xeon, 2026-12-02 stop 56) ended the resumed run 2.94e-4 "
                  "(net.0.weight) from its twin in 18/24 tensors, both controls equal to the twin: the 16-mixed row's "
                  "symptom under bf16 autocast. 12 isolated runs and a session of the in-process DDP/ZeRO tests + "
                  "every autocast row passed on a Zen4 (no AMX). The step trace (judge_differing_resume) names the "
                  "first differing batch and what differs in it, in CI's warnings summary"))],
              "experiment=charlm_cpu callbacks+=chunked_loss chunk_mib=auto-sigkill": [pytest.mark.xfail(
                  strict=False, reason="open (2026-12-02): in the same long local session (XA) the resumed run ended "
                  "up to 2.6e-6 from its twin in 82 of 109 tensors, the two controls equal to the twin; it passed in "
                  "CI's session and alone; on a second AMX Xeon it failed in a two-test session, then passed twice")]}


def _tiny_llama(tmp_path: Path) -> list[str]:
    """finetune_1b_lora names a 1B folder that benchmarks/model_folders.py builds (minutes, 2.5 GB; CI has none): a
    tiny Llama stands in, with the preset's memory levers on (LoRA on a bf16 base, chunked loss, checkpointing)."""
    from tests.helpers.tiny_hf import save_tiny_causal_lm

    folder = save_tiny_causal_lm(tmp_path / "tiny_llama", max_positions=512)
    return [f"model.pretrained={folder}", "data.block_size=64", "data.max_bytes=60000",
            "callbacks=[model_checkpoint,fault_tolerance,chunked_loss,activation_checkpointing,return_freed_memory]"]


def _tiny_chat_llama(tmp_path: Path) -> list[str]:
    """sft_lora names the 0.5B folder (benchmarks/model_folders.py) and the stdlib examples (1,149): a tiny Llama with
    ChatML's tokens and template and 40 short chat examples stand in, with the preset's levers (bf16 base, chunked
    loss) on."""
    from tests.helpers.sft import write_examples
    from tests.helpers.tiny_hf import save_tiny_causal_lm

    folder = save_tiny_causal_lm(tmp_path / "tiny_chat", chat=True, max_positions=512)
    return [f"model.pretrained={folder}", f"data.source={write_examples(tmp_path, 'chat', n=40)}",
            "data.max_length=256", f"data.cache_dir={tmp_path / 'sft_cache'}", "data.samples=1"]


#: presets whose shipped folder is built on demand: what their rows add (from the test's temporary folder)
PRESET_STAND_INS = {"finetune_1b_lora": _tiny_llama, "sft_lora": _tiny_chat_llama}
#: a preset's own shrunk overrides where PRESET does not fit it
PRESET_SHRUNK = {"sft_lora": SFT_PRESET}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _preset_option(preset: str, group: str) -> str | None:
    """The option a preset selects for a group (``override /<group>: <option>``), or None."""
    for line in (CONF / "experiment" / f"{preset}.yaml").read_text().splitlines():
        if line.strip().startswith(f"- override /{group}:"):
            return line.split(":", 1)[1].split("#", 1)[0].strip()
    return None


def _preset_accumulates(preset: str) -> bool:
    return _preset_option(preset, "accumulation") not in (None, "none")


def _cases() -> list:
    cases = []
    seen = set()
    for group in GROUPS:
        for option in options(group):
            if option == DEFAULTS[group] and "default" in seen:
                continue
            seen.add("default" if option == DEFAULTS[group] else f"{group}={option}")
            overrides = [f"{group}={option}"] + (ACCUMULATION.get(option, []) if group == "accumulation" else [])
            schedule = SCHEDULE[option] if group == "accumulation" and option in SCHEDULE else "none"
            name = "default" if option == DEFAULTS[group] else f"{group}={option}"
            cases.append(pytest.param(DIGITS + overrides, KILL_STEP[schedule], None, id=f"{name}-sigkill",
                                      marks=[pytest.mark.slow, *KNOWN_OPEN.get(f"{name}-sigkill", [])]))
            if schedule != "none":
                cases.append(pytest.param(DIGITS + overrides, None, MID_WINDOW[schedule], id=f"{name}-sigterm-mid-window",
                                          marks=[pytest.mark.slow]))
    for name, overrides in LEVERS.items():
        cases.append(pytest.param(overrides, KILL_STEP["preset" if "experiment=" in name else "none"], None,
                                  id=f"{name}-sigkill",
                                  marks=[pytest.mark.slow, *KNOWN_OPEN.get(f"{name}-sigkill", [])]))
    for preset in options("experiment"):
        overrides = [f"experiment={preset}", *PRESET_SHRUNK.get(preset, PRESET)] + (
            PRESET_ACCUMULATION if _preset_accumulates(preset) else [])
        cases.append(pytest.param(overrides, KILL_STEP["preset"], None, id=f"experiment={preset}-sigkill",
                                  marks=[pytest.mark.slow]))
        if _preset_accumulates(preset):
            cases.append(pytest.param(overrides, None, MID_WINDOW["preset"],
                                      id=f"experiment={preset}-sigterm-mid-window", marks=[pytest.mark.slow]))
    return cases


CASES = _cases()


def _precision_choices(checkpoint: Path) -> list[str]:
    """The overrides that name what a run with ``precision=auto`` (and threads/attention ``auto``) chose: its mode,
    thread count and attention kernel. The thread count is in the cache keys of the later timed choices (attention,
    Muon's kernels) and the stopped run timed it before its mode was chosen, under another key: an uninterrupted run
    left to time it again could choose another count, whose sums differ in the last bits."""
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)["GuardedPrecision"]
    pins = [f"precision={saved['mode']}"]
    if saved.get("threads") is not None:
        pins.append(f"precision.threads={saved['threads']}")
    if "attention" in saved:
        pins.append("precision.attention=" + ("null" if saved["attention"] == "default" else saved["attention"]))
    return pins


@pytest.mark.parametrize("args, kill_step, term_batch", CASES)
def test_killed_run_resumes_bitwise_like_the_uninterrupted_run(tmp_path: Path, args: list[str], kill_step: int | None,
                                                               term_batch: int | None) -> None:
    for preset, stand_in in PRESET_STAND_INS.items():
        if f"experiment={preset}" in args:
            args = args + stand_in(tmp_path)
    auto = "precision=auto" in args or any(a.startswith("experiment=") and _preset_option(a[11:], "precision") == "auto"
                                           for a in args)
    stop = kill_at(kill_step) if kill_step is not None else kill_at(mode="sigterm", batch=term_batch)
    # the stopped run first: choices timed on this machine (optimizer kernels, Muon's dtype) are then in the
    # cache, and the uninterrupted run makes the very same ones
    stopped = train(traced(args + stop, tmp_path / "run"), tmp_path / "run")
    expected_exit = -9 if kill_step is not None else 128 + 15
    assert stopped.returncode == expected_exit, explain(stopped)
    if term_batch is not None:
        assert "interrupted at step" in stopped.stdout + stopped.stderr, explain(stopped)

    twin_args = args  # the uninterrupted twin's overrides (precision=auto: what the stopped run chose, below)
    jobs = [(traced(args + ["ckpt_path=last"], tmp_path / "run"), tmp_path / "run")] + (
        [] if auto else [(traced(twin_args, tmp_path / "reference"), tmp_path / "reference")])
    resumed, *reference = train_side_by_side(*jobs)
    assert resumed.returncode == 0, explain(resumed)
    assert "Restored all states from the checkpoint" in resumed.stdout + resumed.stderr, explain(resumed)
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    if auto:  # the uninterrupted run of what this run chose (and kept over the resume: not timed again)
        pins = _precision_choices(last)
        assert "restored from the checkpoint (not timed again)" in resumed.stdout + resumed.stderr, explain(resumed)
        named = tuple(p.partition("=")[0] + "=" for p in pins)
        twin_args = [a for a in args if not a.startswith(named)] + pins
        reference = [train(traced(twin_args, tmp_path / "reference"), tmp_path / "reference")]
    assert reference[0].returncode == 0, explain(reference[0])
    try:
        assert_bitwise_equal(tmp_path / "reference" / "checkpoints" / "last.ckpt", last)
    except AssertionError as difference:  # FloatSumsDiffer included
        judge_differing_resume(tmp_path / "run", tmp_path / "reference", difference)
        _skip_where_uninterrupted_runs_differ(twin_args, tmp_path, difference)
        raise


def _skip_where_uninterrupted_runs_differ(args: list[str], tmp_path: Path, difference: AssertionError) -> None:
    """The control of a resumed run that differs: two more uninterrupted runs, side by side as the resumed run and
    its twin ran. Where one of them differs from the first uninterrupted run, this machine does not repeat the run
    bit for bit even without a stop, so a bitwise resume cannot be judged on it: skipped, saying so and how much
    (what led to it: :data:`KNOWN_OPEN`). Where both equal it, the resume is what differs: the caller re-raises."""
    from lit_speed.tuning.machine_cache import hardware

    reference = tmp_path / "reference" / "checkpoints" / "last.ckpt"
    jobs = [(args, tmp_path / f"control{i}") for i in (1, 2)]
    for (_, folder), control in zip(jobs, train_side_by_side(*jobs)):
        assert control.returncode == 0, explain(control)
        try:
            assert_bitwise_equal(reference, folder / "checkpoints" / "last.ckpt", "the first uninterrupted run")
        except AssertionError as unrepeated:
            pytest.skip(f"this machine ({hardware()}) does not repeat an uninterrupted run bit for bit ({unrepeated}), "
                        f"so the resumed run's difference cannot be judged ({difference})")


def test_the_matrix_covers_every_option_of_the_groups() -> None:
    ids = {p.id for p in CASES}
    for group in GROUPS:
        for option in options(group):
            name = "default" if option == DEFAULTS[group] else f"{group}={option}"
            assert f"{name}-sigkill" in ids
    for preset in options("experiment"):
        assert f"experiment={preset}-sigkill" in ids
    for name in LEVERS:
        assert f"{name}-sigkill" in ids


@pytest.mark.parametrize("controls_differ", [False, True])
def test_a_differing_resume_is_skipped_only_where_two_uninterrupted_runs_differ(monkeypatch, tmp_path: Path,
                                                                              controls_differ: bool) -> None:
    """The control's two outcomes, without training: uninterrupted runs that repeat -> the resume's difference is
    raised (a resume bug fails); runs that do not -> skipped, naming the machine and both differences."""
    import subprocess
    import sys

    here = sys.modules[__name__]
    ran: list[Path] = []
    monkeypatch.setattr(here, "train_side_by_side", lambda *jobs: [ran.append(run_dir) or subprocess.CompletedProcess(
        args, 0) for args, run_dir in jobs])

    def compare(reference: Path, other: Path, what: str = "") -> list[str]:
        if controls_differ and "control2" in str(other):
            raise AssertionError("1/24 tensors differ from the first uninterrupted run")
        return ["w"]

    monkeypatch.setattr(here, "assert_bitwise_equal", compare)
    resumed = AssertionError("18/24 tensors differ from the uninterrupted run")
    if controls_differ:
        with pytest.raises(pytest.skip.Exception, match=r"does not repeat .*1/24 .*cannot be judged .*18/24"):
            _skip_where_uninterrupted_runs_differ(["seed=7"], tmp_path, resumed)
    else:  # returns: the caller re-raises (a skip here would read as a skipped test, not a failed one)
        try:
            _skip_where_uninterrupted_runs_differ(["seed=7"], tmp_path, resumed)
        except pytest.skip.Exception as skipped:
            pytest.fail(f"skipped although the uninterrupted runs repeat: {skipped}")
    assert sorted(p.name for p in ran) == ["control1", "control2"]
