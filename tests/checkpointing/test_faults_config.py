"""Bad configs end ``scripts/train.py`` before training with one message naming the setting and the fix.

Each case runs the real entry point in a fresh interpreter once; two tests read its output:
- ``..._refused_before_training``: exit code != 0, the component's message, and no training step ran;
- ``..._one_clean_message``: exit code 2 and nothing but that message: no traceback.
Cross-component combinations (precision x strategy, strategy x optimizer, accumulation x memory) are refused
by the component that owns the constraint, naming both sides.
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from subprocess import CompletedProcess
from tempfile import mkdtemp

import pytest
import torch

from tests.helpers.fault_scripts.runs import explain, train
from tests.run.test_bad_input import PRESET_SWITCHES

DAMAGED = Path(mkdtemp(prefix="damaged_ckpt_")) / "damaged.ckpt"
DAMAGED.write_bytes(b"not a torch.save archive")
STRAY = Path(mkdtemp(prefix="stray_pt_")) / "final.pt"  # a valid torch file in a folder DeepSpeed did not write
torch.save({"w": torch.zeros(2)}, STRAY)


def preset_switch(command: str) -> tuple[list[str], str, bool]:
    """A preset-switch row of the in-process table (``tests/run/test_bad_input.py``), here as a fresh process: the
    same message, one source for both (slow: the in-process twin runs in the default tier)."""
    return command.split(), PRESET_SWITCHES[command].removeprefix("^").removesuffix("$"), True


# name: (overrides, what the message must say, slow?)
CASES = {
    "unknown_option": (["precision=fp8"], r"precision=fp8: unknown option 'fp8' for group 'precision'\. Valid choices",
                       True),  # slow: its twin test_train_entry.py::test_unknown_option_exits_... stays
    "unknown_key": (["trainer.max_epoch=3"], r"no key 'max_epoch' in 'trainer'\. Did you mean trainer\.max_epochs",
                    False),
    # slow: its twin test_train_entry.py::test_component_value_error_is_reported_without_hydra_wrapper stays
    "out_of_range_constructor": (["data.batch_size=0"],
                                 r"data\.batch_size=0: DigitsDataModule\(batch_size=0\): batch_size must be "
                                 r">= 1, got 0",
                                 True),
    "damaged_checkpoint": ([f"ckpt_path={DAMAGED}"], r"damaged\.ckpt is unusable: it is truncated or not a "
                           r"torch\.save archive.*Fix: ", False),
    "out_of_range_model": (["model.depth=0"], r"model\.depth=0: MLPClassifier\(depth=0\): depth and hidden "
                            r"must be >= 1, got depth=0", True),
    "validation_budget_fraction": (["callbacks=validation_budget", "callbacks.validation_budget.max_fraction=1.5"],
                                   r"callbacks\.validation_budget\.max_fraction=1\.5: ValidationBudget\(max_fraction="
                                   r"1\.5\): max_fraction must be in \(0, 1\)", True),
    "threads_zero": (["precision.threads=0"], r"precision\.threads=0: GuardedPrecision\(threads=0\): threads must be "
                     r"an int >= 1, 'auto' or None", True),
    "muon_ns_dtype": (["experiment=charlm_fast", "optimizer.ns_dtype=fp8", "data.max_bytes=200000"],
                      r"optimizer\.ns_dtype='fp8': MuonAdamW\(ns_dtype='fp8'\): ns_dtype must be one of", True),
    "bad_policy": (["callbacks.fault_tolerance.on_nonfinite_weights=ignore"],
                   r"on_nonfinite_weights must be one of \('warn', 'raise'\), got 'ignore'\. Fix", True),
    "out_of_range_trainer": (["trainer.devices=0"], r"Trainer\(devices=0\)` value is not a valid input", True),
    "out_of_range_in_setup": (["data.val_fraction=1.5"], r"val_fraction must be in \(0, 1\), got 1\.5", True),
    "missing_checkpoint": (["ckpt_path=/nonexistent/x.ckpt"], r"ckpt_path=/nonexistent/x\.ckpt: no such file\. Fix",
                           True),
    "unknown_curriculum_pacing": (["data=digits_curriculum", "data.pacing=foo"],
                                  r"pacing must be one of \('linear', .*got 'foo'", True),
    "incompatible_fp16_zero_cpu": (["precision=16-mixed", "strategy=zero2"],
                                   r"precision='16-mixed' is not supported by DeepSpeed on the CPU.*use precision=",
                                   True),
    "incompatible_offload_torch_optimizer": (["strategy=zero2_offload", "optimizer=adamw"],
                                             r"offload_optimizer=True needs an optimizer that runs on CPU.*got AdamW"
                                             r".*optimizer=cpu_adam", True),
    "incompatible_auto_micro_batch_without_budget": (["accumulation=ramp", "accumulation.micro_batch=auto"],
                                                     r"accumulation\.micro_batch='auto': AccumulationScheduler\(micro_batch='auto'\): "
                                                     r"micro_batch='auto' needs .*memory_budget_mb",
                                                     True),
    # issue 17: every command line a new user tried that ended in a traceback, a hang or silence
    "data_without_its_model": (["data=charlm"], r"does not fit model \(MLPClassifier\).*Fix: model=gpt.*"
                                                r"experiment=charlm_cpu", False),
    "model_without_its_data": (["model=gpt"], r"does not fit model \(GPTModule\).*Fix: model=mlp, or data=charlm",
                               True),
    "curriculum_data_without_its_model": (["data=charlm_curriculum"], r"does not fit model \(MLPClassifier\)", True),
    "lr_not_a_number": (["optimizer.lr=abc"], r"optimizer\.lr='abc': expected a number.*Fix", True),
    "lr_infinite": (["optimizer.lr=inf"], r"optimizer\.lr=inf: must be finite\. Fix", True),
    "lr_zero": (["optimizer.lr=0"], r"optimizer\.lr=0: the model would not train.*Fix", True),
    "one_beta": (["optimizer.betas=[0.9]"], r"optimizer\.betas=\[0\.9\]: needs two numbers.*Fix", True),
    "unbalanced_bracket": (["trainer.max_steps=[1,2"], r"not a valid override.*Fix: balance its brackets", True),
    "folder_as_checkpoint": ([f"ckpt_path={DAMAGED.parent}"], r"is a folder, not a checkpoint( \(it holds damaged\.ckpt\))?\. Fix", True),
    "val_check_interval_zero": (["trainer.val_check_interval=0"], r"trainer\.val_check_interval=0: .*Fix", True),
    "check_val_every_zero": (["trainer.check_val_every_n_epoch=0"], r"check_val_every_n_epoch=0: must be >= 1", True),
    "unknown_monitor": (["monitor=val/nonexistent"], r"monitor=val/nonexistent: the model does not log it.*Fix",
                        True),
    "negative_clip": (["trainer.gradient_clip_val=-1"], r"gradient_clip_val=-1: a negative clip value.*Fix", True),
    "gpt_without_layers": (["experiment=charlm_cpu", "model.n_layer=0"], r"must be >= 1, got n_layer=0.*Fix", True),
    "no_training_batches": (["trainer.limit_train_batches=0"], r"limit_train_batches=0: the run would make no", True),
    "no_steps": (["trainer.max_steps=0"], r"trainer\.max_steps=0: the run would make no optimizer step", True),
    "accumulation_beyond_the_epoch": (["accumulation=fixed", "accumulation.factors=[[0,100000]]"],
                                      r"accumulation factor 100000 > the 23 training batches of an epoch.*Fix", True),
    "validation_never_reached": (["trainer.val_check_interval=100000", "trainer.check_val_every_n_epoch=null",
                                  "validate=false"],
                                 r"val_check_interval=100000 > the 23 training batches.*never be validated", True),
    "block_size_beyond_memory": (["experiment=charlm_cpu", "data.block_size=100000"],
                                 r"data\.block_size=100000 x data\.batch_size=12: activations need about .* GiB "
                                 r"\(planner estimate\)", True),
    # issue 28: command lines that still ended in a traceback, or were refused only after the processes started
    "interpolation_to_a_missing_key": (["optimizer.lr=${nonexistent.key}"],
                                       r"optimizer\.lr=\$\{nonexistent\.key\}: the interpolation points at "
                                       r"'nonexistent\.key'.*Fix", False),
    "folder_with_a_stray_file_as_checkpoint": ([f"ckpt_path={STRAY.parent}"],
                                               r"is a folder, not a checkpoint \(it holds final\.pt\)\. Fix", True),
    "precision_under_trainer": (["trainer.precision=bf16-mixed"],
                                r"precision is chosen by its own config group.*Fix: precision=bf16-mixed", True),
    "run_dir_not_creatable": (["hydra.run.dir=/proc/forbidden"],
                              r"hydra\.run\.dir=/proc/forbidden: the run folder cannot be created.*Fix", True),
    # issue 24: switching a preset's component kept the preset's keys for the old one (a TypeError at the first step)
    "preset_optimizer_switched": preset_switch("experiment=charlm_fast optimizer=adamw"),
    "preset_optimizer_switched_to_sgd": preset_switch("experiment=charlm_fast optimizer=sgd"),
    "accumulation_in_steps_and_samples": (["accumulation=fixed", "accumulation.effective_batch=[[0,64]]"],
                                          r"give exactly one of factors=.* or effective_batch=", True),
    "own_config_dir_missing": (["--config-dir", "/nonexistent/my_conf", "model=mine"],
                               r"--config-dir /nonexistent/my_conf: no such folder.*Fix", True),
    "bf16_master_on_two_processes": (["precision=bf16-master", "strategy=ddp", "trainer=ddp_cpu", "trainer.devices=2"],
                                     r"precision=bf16-master with DDPStrategy on 2 processes.*Fix: "
                                     r"precision=bf16-mixed", True),
    # issue 26: fine-tuning options
    "init_without_a_path": (["init=weights"], r"init\.path=\?\?\?: required, and not given\. Fix: init\.path=", False),
    "init_from_a_missing_file": (["init=weights", "init.path=/nonexistent/w.pt"],
                                 r"init\.path=/nonexistent/w\.pt: InitWeights\(path=/nonexistent/w\.pt\): no such file "
                                 r"or folder\. Fix", True),
    "init_from_other_weights": (["init=weights", f"init.path={STRAY}"],
                                r"InitWeights\(path=.*final\.pt\): none of the file's 1 tensors name a tensor of "
                                r"MLPClassifier.*Fix", True),
    "peft_target_matches_nothing": (["peft=lora", "peft.target_modules=[qvk]"],
                                    r"peft\.target_modules=\['qvk'\]: PEFTAdapters\(target_modules=\['qvk'\]\): 'qvk' "
                                    r"matches no module name or class of MLPClassifier\. Module names: net, .*Fix: ",
                                    False),
    "peft_rank_zero": (["peft=lora", "peft.r=0"], r"peft\.r=0: PEFTAdapters\(r=0\): the adapter rank must be an int "
                       r">= 1\. Fix: r=8", True),
    "hf_model_without_a_folder": (["model=hf_causal_lm", "data=text_folder", "data.root=/tmp"],
                                  r"model\.pretrained=\?\?\?: required, and not given\. Fix: model\.pretrained=", True),
    # issue 33: the signal deadline (FaultTolerance(signal_deadline_s=...)): seconds > 0, or null
    "signal_deadline_negative": (["callbacks.fault_tolerance.signal_deadline_s=-1"],
                                 r"signal_deadline_s=-1: FaultTolerance\(signal_deadline_s=-1\): signal_deadline_s must "
                                 r"be a number of seconds > 0, or None.*Fix: signal_deadline_s=25", True),
    "signal_deadline_not_a_number": (["callbacks.fault_tolerance.signal_deadline_s=soon"],
                                     r"signal_deadline_s must be a number of seconds > 0, or None to wait for the "
                                     r"running step, got 'soon'", True),
    # issue 32: memory levers
    "chunked_loss_without_a_language_model": (["callbacks=[chunked_loss]"],
                                              r"callbacks\.chunked_loss: ChunkedLMLoss: MLPClassifier holds no Hugging "
                                              r"Face causal LM .*Fix: drop chunked_loss", True),
    "bf16_base_under_bf16_true": (["peft=lora", "peft.base_dtype=bf16", "precision=bf16-true"],
                                  r"peft\.base_dtype=bf16: PEFTAdapters\(base_dtype=bf16\): precision=bf16-true casts "
                                  r"the whole module.*Fix: precision=32-true or bf16-mixed", True),
    # issue 32: low-bit optimizer states
    "low_bit_under_zero": (["strategy=zero2", "optimizer=adamw8bit"],
                           r"strategy: ZeroStrategy: AdamW8bit cannot train under DeepSpeed ZeRO: .*Fix: strategy=auto "
                           r"or strategy=ddp to keep AdamW8bit", True),
    # issue 34: Muon's refusal under ZeRO lives with Muon (zero_refusal), asked through check_zero_optimizer
    "muon_under_zero": (["model=gpt", "data=charlm", "optimizer=muon", "strategy=zero2", "data.max_bytes=200000"],
                        r"ZeroStrategy: MuonAdamW cannot train under DeepSpeed ZeRO: ZeRO flattens parameters into 1-D "
                        r"partitions.*Fix: strategy=auto or strategy=ddp to keep MuonAdamW", True),
    # issue 50: Lightning's sentence without the key; a negative LoRA alpha trained silently
    "max_steps_negative": (["trainer.max_steps=-5"], r"trainer\.max_steps=-5: a number of optimizer "
                           r"steps >= 1, or -1 for no limit\. Fix: trainer\.max_steps=5", True),
    "peft_alpha_negative": (["peft=lora", "peft.alpha=-1"], r"peft\.alpha=-1: PEFTAdapters\(alpha=-1\): "
                            r"LoRA scales its update by alpha / r, so alpha must be a number > 0", True),
    "low_bit_odd_block": (["optimizer=adamw4bit", "optimizer.block_size=3"],
                          r"optimizer\.block_size=3: AdamW4bit\(block_size=3\): block_size must be an even int", True),
    "preset_optimizer_switched_to_low_bit": preset_switch("experiment=charlm_fast optimizer=adamw8bit"),
}

# ---- issue 33 (checks): one line where a new user got a traceback, silence or a misleading line ----------------
OWN_CONF = Path(mkdtemp(prefix="own_conf_"))  # a user's config folder with a file that is not YAML
(OWN_CONF / "model").mkdir()
(OWN_CONF / "model" / "broken.yaml").write_text("_target_: my_pkg.Model\nlayers: [1, 2\nwidth: 3\n")
OTHER_MODEL = Path(mkdtemp(prefix="other_model_")) / "other.pt"  # 1 tensor in common with the MLP, 2 of its own
torch.save({"net.0.weight": torch.zeros(256, 64), "encoder.0.weight": torch.zeros(2), "encoder.1.weight": torch.zeros(2)},
           OTHER_MODEL)
CASES.update({
    "own_config_not_yaml": (["--config-dir", str(OWN_CONF), "model=broken"],
                            r"model=broken: .*broken\.yaml is not valid YAML \(.*line 3, column \d+; while parsing a "
                            r"flow sequence from line 2\)\. Fix: correct that line", False),
    "nested_key_from_the_top": (["validation_budget.max_fraction=2"],
                                r"it is callbacks\.validation_budget\.max_fraction, which the callbacks option "
                                r"validation_budget adds\. Fix: 'callbacks=\[default,validation_budget\]'", True),
    "batch_transform_not_a_function": (["data.batch_transform=foo"],
                                       r"data\.batch_transform='foo': DigitsDataModule\(batch_transform='foo'\): must "
                                       r"be a function", True),
    "effective_batch_not_a_multiple": (["accumulation=ramp", "accumulation.factors=null",
                                        "accumulation.effective_batch=[[0,100]]"],
                                       r"effective_batch\[0\] = 100 is not divisible by micro_batch \(64\) x world size "
                                       r"\(1\) = 64; use 64 or 128", True),
    "attention_unknown": (["precision.attention=fast"], r"precision\.attention='fast': GuardedPrecision\(attention="
                          r"'fast'\): one of auto, math, flash, efficient, cudnn or None", True),
    "threads_above_the_cores": (["precision.threads=1000"], r"precision\.threads=1000: GuardedPrecision\(threads=1000\)"
                                r": more than the \d+ CPU core\(s\) this process may run on", True),
    "peft_option_unknown": (["peft=lora", "+peft.options.use_foo=true"],
                            r"'use_foo' is not an argument of peft's LoraConfig\. Did you mean use_dora\? It takes: ",
                            True),
    "export_folder_not_writable": (["peft=lora", "peft.export_dir=/proc/forbidden"],
                                   r"peft\.export_dir=/proc/forbidden: PEFTAdapters\(export_dir=/proc/forbidden\): the "
                                   r"merged model could not be written there after training", True),
    "validation_steps_and_batches_both": (["callbacks=[default,validate_every_n_steps]", "trainer.val_check_interval=5"],
                                          r"callbacks\.validate_every_n_steps: ValidateEveryNSteps: Trainer\("
                                          r"val_check_interval=5\) would be ignored.*Fix: trainer\.val_check_interval="
                                          r"null", True),
    "init_from_another_model": (["init=weights", f"init.path={OTHER_MODEL}"],
                                r"only 1 of MLPClassifier's \d+ tensors match the file's 3 by name and shape: it holds "
                                r"another model", True),
})


def _run(case: str) -> tuple[CompletedProcess, Path]:
    run_dir = Path(mkdtemp(prefix=f"bad_config_{case}_"))
    return train([*CASES[case][0], "trainer.max_epochs=1"], run_dir, timeout=300), run_dir


@pytest.fixture(scope="module")
def runs(request) -> Iterator[Callable[[str], tuple[CompletedProcess, Path]]]:
    """Every selected case's run, started at once on a pool of as many workers as this process may use cores.

    Each case is a fresh interpreter that stops before training: its time is imports and config checks on one core,
    so the pool cuts this file's time by the number of cores (the slow tier's longest file: 60 interpreters)."""
    cases = list(dict.fromkeys(item.callspec.params["case"] for item in request.session.items
                               if item.path == Path(__file__) and hasattr(item, "callspec")))
    with ThreadPoolExecutor(max(1, min(4, len(os.sched_getaffinity(0))))) as pool:
        futures = {case: pool.submit(_run, case) for case in cases}
        yield lambda case: futures[case].result()
        for future in futures.values():  # `pytest -x` stopped early: the cases not started are not needed
            future.cancel()


PARAMS = [pytest.param(case, marks=[pytest.mark.slow] if slow else [], id=case)
          for case, (_, _, slow) in CASES.items()]


@pytest.mark.parametrize("case", PARAMS)
def test_bad_config_is_refused_before_training_with_a_message_naming_the_setting(case, runs):
    proc, run_dir = runs(case)
    assert proc.returncode != 0, explain(proc)
    assert re.search(CASES[case][1], proc.stderr), f"message {CASES[case][1]!r} not in stderr\n{explain(proc)}"
    assert not (run_dir / "checkpoints").exists() and "Epoch 0" not in proc.stdout, "training started"


@pytest.mark.parametrize("case", PARAMS)
def test_bad_config_output_is_one_clean_message(case, runs):
    proc, _ = runs(case)
    assert proc.returncode == 2, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    assert len(re.findall(r"^Config error: ", proc.stderr, flags=re.M)) == 1, explain(proc)
