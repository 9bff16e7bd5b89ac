"""The bad-input matrix, in process: every command line that cannot train is refused with a message naming the fix.

Config-only cases go through :func:`preflight` (what ``scripts/train.py`` runs first, no model built); cases that
need the built model or the Trainer go through :func:`train`. ``tests/checkpointing/test_faults_config.py`` runs
the same cases through the real entry point (exit code 2, one ``Config error:`` line).
"""
from __future__ import annotations

import json

import pytest
import torch

from lit_speed.data.charlm import CharLMDataModule
from lit_speed.data.digits import DigitsDataModule
from lit_speed.models.gpt import GPTModule
from lit_speed.models.mlp import MLPClassifier
from lit_speed.run.config_check import preflight
from lit_speed.run.config_error import ConfigError
from lit_speed.run.model_checks import check_activation_memory
from lit_speed.run.runner import build, train
from lit_speed.run_contract import BatchConsumer, BatchSource
from tests.helpers.repo import CONF, compose_config

DATA = sorted(p.stem for p in (CONF / "data").glob("*.yaml"))
MODELS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
MATCHING = {"digits": "mlp", "digits_curriculum": "mlp", "charlm": "gpt", "charlm_curriculum": "gpt",
            "text_folder": "hf_causal_lm", "sft": "hf_causal_lm"}
# what a pair needs besides the two options (a required value each): a tiny HF folder is made by the test that builds
PAIR_VALUES = {"text_folder": ["model.pretrained=/path/to/hf_folder", "data.root=/path/to/texts"],
               "sft": ["model.pretrained=/path/to/hf_folder", "data.source=/path/to/examples.jsonl"]}
SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "logger=none",
         "validate=false", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


def test_every_data_option_has_a_matching_model():
    assert sorted(MATCHING) == DATA, "a new data option: say which model it feeds (and declare its batch_kind)"


def test_bundled_datamodules_and_models_declare_what_they_yield_and_take():
    # the pairing check reads these declarations (lit_speed.run_contract), not class names
    assert isinstance(DigitsDataModule, BatchSource) and isinstance(CharLMDataModule, BatchSource)
    assert isinstance(MLPClassifier, BatchConsumer) and isinstance(GPTModule, BatchConsumer)
    assert DigitsDataModule.batch_kind in MLPClassifier.accepted_batch_kinds
    assert CharLMDataModule.batch_kind in GPTModule.accepted_batch_kinds
    assert DigitsDataModule.batch_kind not in GPTModule.accepted_batch_kinds


KIND = {"mlp": ("MLPClassifier", ("features->class",)), "gpt": ("GPTModule", ("tokens->next-token",)),
        "hf_causal_lm": ("HFCausalLM", ("tokenizer-ids->next-token", "token-dict->next-token"))}
YIELDS = {"digits": "features->class", "digits_curriculum": "features->class", "charlm": "tokens->next-token",
          "charlm_curriculum": "tokens->next-token", "text_folder": "tokenizer-ids->next-token",
          "sft": "token-dict->next-token"}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("data", DATA)
def test_data_model_pair_builds_or_is_refused_naming_both_fixes(make_cfg, tmp_path, data, model):
    overrides = [f"data={data}", f"model={model}"]
    if MATCHING[data] == model:
        if data in PAIR_VALUES:
            from tests.helpers.sft import write_examples
            from tests.helpers.tiny_hf import STDLIB, save_tiny_causal_lm

            folder = save_tiny_causal_lm(tmp_path / "hf", chat=data == "sft", max_positions=1024)
            overrides += [f"model.pretrained={folder}"]
            overrides += [f"data.root={STDLIB / 'json'}"] if data == "text_folder" else \
                [f"data.source={write_examples(tmp_path, 'chat', n=8)}", f"data.cache_dir={tmp_path / 'cache'}"]
        preflight(overrides)
        parts = build(make_cfg(overrides))
        assert type(parts["model"]).__name__ == KIND[model][0]
        return
    cls, takes = KIND[model]
    fits, yields = MATCHING[data], YIELDS[data]
    others = ", or ".join(f"data={d}" for d in sorted(DATA) if YIELDS[d] in takes and "curriculum" not in d)
    with pytest.raises(ConfigError, match=rf"data \(\w+\) does not fit model \({cls}\): it yields '{yields}' batches, "
                                          rf"{cls} takes {' or '.join(repr(t) for t in takes)}\. Fix: model={fits}, or "
                                          rf"{others}(, or experiment=\w+ \(data=\w+ model=\w+\))*$"):
        preflight(overrides)


def test_a_pair_that_declares_nothing_is_not_checked(make_cfg):
    # a foreign class without batch_kind / accepted_batch_kinds: nothing to compare, the run decides
    preflight(["data=charlm", "model._target_=tests.run.test_bad_input.UndeclaredMLP"])


class UndeclaredMLP(MLPClassifier):
    accepted_batch_kinds = None  # type: ignore[assignment]


@pytest.mark.parametrize("overrides", [["data=charlm"], ["data=charlm_curriculum"], ["model=gpt"]])
def test_a_single_data_or_model_option_is_refused_before_anything_starts(overrides):
    with pytest.raises(ConfigError, match=r"does not fit model \(\w+\): it yields .*Fix: "):
        preflight(overrides)


@pytest.mark.parametrize("strategy", ["zero2_offload", "zero3_offload"])
def test_offload_selects_cpu_adam_keeping_lr_and_betas(make_cfg, strategy):
    cfg = make_cfg([f"strategy={strategy}", "optimizer.lr=0.02", "optimizer.betas=[0.8,0.9]"])
    assert cfg.optimizer._target_ == "lit_speed.optim.cpu_adam.CPUAdam"
    assert cfg.optimizer.lr == 0.02 and list(cfg.optimizer.betas) == [0.8, 0.9]
    assert make_cfg(["experiment=charlm_cpu", f"strategy={strategy}"]).optimizer.lr == 0.003  # the preset's lr
    assert make_cfg([f"strategy={strategy}", "optimizer=adamw"]).optimizer._target_ == "torch.optim.AdamW"


def test_offload_with_an_explicit_gpu_optimizer_is_refused_naming_the_fix(make_cfg):
    with pytest.raises(ConfigError, match=r"offload_optimizer=True needs an optimizer that runs on CPU.*got AdamW"
                                          r".*optimizer=cpu_adam"):
        train(make_cfg(["strategy=zero2_offload", "optimizer=adamw", *SHORT]))


# override -> what the one line must say (the setting and the fix)
PREFLIGHT_CASES = {
    "optimizer.lr=abc": r"optimizer\.lr='abc': expected a number, got str\. Fix: optimizer\.lr=",
    "optimizer.lr=inf": r"optimizer\.lr=inf: must be finite\. Fix",
    "optimizer.lr=0": r"optimizer\.lr=0: the model would not train .*Fix: optimizer\.lr=1e-3",
    "optimizer.betas=[0.9]": r"optimizer\.betas=\[0\.9\]: needs two numbers in \[0, 1\)\. Fix: optimizer\.betas=",
    "optimizer.weight_decay=-1": r"optimizer\.weight_decay=-1: must be >= 0\. Fix",
    "trainer.max_steps=[1,2": r"trainer\.max_steps=\[1,2: not a valid override .*Fix: balance its brackets",
    "trainer.val_check_interval=0": r"trainer\.val_check_interval=0: .*Fix: trainer\.val_check_interval=",
    "trainer.check_val_every_n_epoch=0": r"trainer\.check_val_every_n_epoch=0: must be >= 1\. Fix",
    "trainer.gradient_clip_val=-1": r"trainer\.gradient_clip_val=-1: a negative clip value clips nothing\. Fix",
    "trainer.max_steps=0": r"trainer\.max_steps=0: the run would make no optimizer step\. Fix: trainer\.max_steps=-1",
    # issue 50: Lightning's own sentence named no key
    "trainer.max_steps=-5": r"^trainer\.max_steps=-5: a number of optimizer steps >= 1, or -1 for no limit\. Fix: "
                            r"trainer\.max_steps=5 or trainer\.max_steps=-1$",
    "trainer.max_epochs=-3": r"^trainer\.max_epochs=-3: a number of epochs >= 1, or -1 for no limit\. Fix: ",
    "trainer.max_epochs=0": r"trainer\.max_epochs=0: the run would make no optimizer step\. Fix",
    "trainer.limit_train_batches=0": r"trainer\.limit_train_batches=0: the run would make no optimizer step\. Fix",
    "data.batch_size=abc": r"data\.batch_size='abc': DigitsDataModule expects int, got str\. Fix: data\.batch_size=",
    "model.hidden=abc": r"model\.hidden='abc': MLPClassifier expects int, got str\. Fix: model\.hidden=",
    "seed=abc": r"seed='abc': expected an integer or null\. Fix: seed=42",
    "init=weights": r"init\.path=\?\?\?: required, and not given\. Fix: init\.path=<a value>",
    "model=hf_causal_lm": r"does not fit model \(HFCausalLM\): it yields 'features->class' batches, HFCausalLM takes "
                          r"'tokenizer-ids->next-token' or 'token-dict->next-token'\. Fix: model=mlp, or data=sft, or "
                          r"data=text_folder, or experiment=finetune_1b_lora \(data=text_folder model=hf_causal_lm\), or "
                          r"experiment=sft_lora \(data=sft model=hf_causal_lm\)$",
}


GROUPS = ["optimizer", "precision", "strategy", "accumulation", "callbacks", "logger", "trainer", "experiment", "debug",
          "hparams_search", "peft"]
VALID = [[f"data={d}", f"model={m}", *PAIR_VALUES.get(d, [])] for d, m in MATCHING.items()] + [
    ["init=none"], ["init=weights", "init.path=/path/to/weights.pt"]] + [
    [f"{g}={p.stem}"] for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]


@pytest.mark.parametrize("overrides", VALID, ids=" ".join)
def test_every_shipped_option_passes_the_checks(overrides):
    preflight(overrides)  # no false refusal: each option of conf/ (data with its model) is accepted


@pytest.mark.parametrize("override", list(PREFLIGHT_CASES))
def test_preflight_refuses_with_the_setting_and_the_fix(override):
    with pytest.raises(ConfigError, match=PREFLIGHT_CASES[override]):
        preflight([override])


def test_a_folder_is_not_a_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match=rf"ckpt_path={tmp_path}: is a folder, not a checkpoint\. Fix: "):
        preflight([f"ckpt_path={tmp_path}"])
    (tmp_path / "latest").write_text("global_step1")  # what DeepSpeed writes into its checkpoint folder
    preflight([f"ckpt_path={tmp_path}"])


@pytest.mark.parametrize(("overrides", "message"), [
    (["monitor=val/nonexistent"], r"monitor=val/nonexistent: the model does not log it \(it logs val/acc, "
                                  r"val/loss\)\. Fix: monitor="),
    (["accumulation=fixed", "accumulation.factors=[[0,100000]]"],
     r"accumulation factor 100000 > the 2 training batches of an epoch.*Fix: accumulation\.factors"),
    (["trainer.val_check_interval=100000", "trainer.check_val_every_n_epoch=null"],
     r"trainer\.val_check_interval=100000 > the 2 training batches of this run: val/acc would never be validated"),
    (["trainer.check_val_every_n_epoch=5"], r"check_val_every_n_epoch=5 > trainer\.max_epochs=1.*Fix"),
    (["trainer.limit_train_batches=0.0001"], r"limit_train_batches"),  # Lightning refuses it itself
])
def test_run_plan_is_refused_before_the_first_training_batch(make_cfg, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        train(make_cfg([*SHORT, "callbacks=model_checkpoint", *overrides]))
    assert not (tmp_path / "checkpoints").exists(), "a training step ran"


def test_validation_only_after_fit_is_said_before_the_run_and_the_run_goes_on(make_cfg):
    overrides = [*SHORT, "trainer.val_check_interval=100000", "trainer.check_val_every_n_epoch=null", "validate=true"]
    with pytest.warns(UserWarning, match=r"trainer\.val_check_interval=100000 > the 2 training batches of this run: "
                                         r"val/acc is validated only once, after fit.*Fix: "):
        summary = train(make_cfg(overrides))
    assert summary["global_step"] == 2 and "val/acc" in summary["final_val"]


def test_gpt_with_no_layers_is_refused(make_cfg):
    with pytest.raises(ConfigError, match=r"model\.n_layer=0: GPTModule\(n_layer=0\): n_layer, n_head, n_embd and "
                                          r"block_size must be >= 1, got n_layer=0.*Fix: n_layer="):
        train(make_cfg(["experiment=charlm_cpu", "model.n_layer=0", *SHORT]))


def test_block_size_beyond_memory_is_refused_with_the_planner_estimate(make_cfg):
    cfg = make_cfg(["experiment=charlm_cpu", "data.block_size=100000"])
    with pytest.raises(ConfigError, match=r"data\.block_size=100000 x data\.batch_size=12: activations need about "
                                          r"[\d.,]+ GiB \(planner estimate\), 1\.0 GiB is free\. Fix"):
        check_activation_memory(cfg, available_bytes=2**30)
    check_activation_memory(make_cfg(["experiment=charlm_cpu", "data.block_size=512"]), available_bytes=2**30)


@pytest.fixture
def adamw_checkpoint(make_cfg, tmp_path):
    """A digits checkpoint written by this repo's default run (MLP, AdamW)."""
    train(make_cfg([*SHORT, "callbacks=model_checkpoint"]))
    return tmp_path / "checkpoints" / "last.ckpt"


def test_resume_with_another_model_names_what_does_not_match(make_cfg, adamw_checkpoint, tmp_path):
    checkpoint = torch.load(adamw_checkpoint, weights_only=False)
    checkpoint["state_dict"] = GPTModule().state_dict()  # what experiment=charlm_cpu writes
    gpt_ckpt = tmp_path / "charlm.ckpt"
    torch.save(checkpoint, gpt_ckpt)
    with pytest.raises(ConfigError, match=rf"ckpt_path={gpt_ckpt}: written by another model \(.*\); MLPClassifier "
                                          "cannot resume it. Fix: "):
        train(make_cfg([*SHORT, f"ckpt_path={gpt_ckpt}"]))


def test_resume_with_another_optimizer_names_what_does_not_match(make_cfg, adamw_checkpoint):
    with pytest.raises(ConfigError, match=r"written with another optimizer \(its state lacks .*momentum.*\)\. "
                                          r"Fix: the optimizer= of the run that wrote it"):
        train(make_cfg([*SHORT, "optimizer=sgd", f"ckpt_path={adamw_checkpoint}"]))
    summary = train(make_cfg([*SHORT, "trainer.max_epochs=2", f"ckpt_path={adamw_checkpoint}"]))  # same: resumes
    assert summary["global_step"] == 4


@pytest.mark.parametrize("strategy", ["zero2", "zero2_offload"])
def test_a_low_bit_optimizer_under_zero_is_refused_naming_the_fix(make_cfg, strategy):
    # zero2_offload would swap in cpu_adam; an explicit optimizer= wins, and ZeRO refuses it before its engine
    with pytest.raises(ConfigError, match=r"^strategy: ZeroStrategy: AdamW8bit cannot train under DeepSpeed ZeRO: .*"
                                          r"Fix: strategy=auto or strategy=ddp to keep AdamW8bit, or a ZeRO strategy "
                                          r"with optimizer=adamw \(offload: optimizer=cpu_adam\)$"):
        train(make_cfg([f"strategy={strategy}", "optimizer=adamw8bit", *SHORT]))


def test_resume_across_low_bit_and_whole_state_optimizers_is_refused(make_cfg, adamw_checkpoint, tmp_path):
    # the param groups tell whose state it is (AdamW8bit.load_state_dict also refuses a whole moment: tests/optim)
    with pytest.raises(ConfigError, match=r"written with another optimizer \(its state lacks state_bits\)\. Fix: the "
                                          r"optimizer= of the run that wrote it"):
        train(make_cfg([*SHORT, "optimizer=adamw8bit", f"ckpt_path={adamw_checkpoint}"]))
    train(compose_config([*SHORT, "callbacks=model_checkpoint", "optimizer=adamw8bit"], tmp_path / "low_bit"))
    low_bit = tmp_path / "low_bit" / "checkpoints" / "last.ckpt"
    assert torch.load(low_bit, weights_only=True)["optimizer_states"][0]["param_groups"][0]["state_bits"] == 8
    with pytest.raises(ConfigError, match=r"written with another optimizer \(its state carries state_bits, which this "
                                          r"optimizer does not keep\)\. Fix: the optimizer= of the run that wrote it"):
        train(make_cfg([*SHORT, "trainer.max_epochs=2", f"ckpt_path={low_bit}"]))


@pytest.mark.slow  # the first use JIT-builds DeepSpeed's CPU Adam (~2 min, then cached)
def test_offload_option_alone_runs_with_cpu_adam(tmp_path):
    from tests.helpers.repo import run_train_script

    result = run_train_script(["strategy=zero2_offload", "trainer.fast_dev_run=true", f"hydra.run.dir={tmp_path}"],
                              timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["global_step"] == 1
    assert summary["config"]["optimizer"]["_target_"] == "lit_speed.optim.cpu_adam.CPUAdam"
    assert summary["startup"]["zero"].startswith("stage 2, offload: optimizer")


# ---- switching a preset's optimizer, precision or accumulation: it runs, or stops in one line naming the fix ----
# (issue 24: `experiment=charlm_fast optimizer=adamw` ended in a TypeError on Muon's `adamw_lr` at the first step)
TAKES_NO = r"\(it takes: .*\); a preset or the option whose _target_ was replaced sets them\."
PRESET_SWITCHES = {
    # the preset's Muon settings AdamW does not take are all named in the one line (its betas AdamW takes)
    "experiment=charlm_fast optimizer=adamw": r"^optimizer\.adjust_lr_fn=match_rms_adamw, optimizer\.adamw_lr=[\d.]+, "
                                              r"optimizer\.momentum=[\d.]+: AdamW takes no arguments 'adjust_lr_fn', "
                                              rf"'adamw_lr', 'momentum' {TAKES_NO} Fix: ~optimizer\.adjust_lr_fn "
                                              r"~optimizer\.adamw_lr ~optimizer\.momentum to drop them \(.*lr.*\), or "
                                              r"optimizer=<muon> \(takes them\)$",
    "experiment=charlm_fast optimizer=sgd": r"^optimizer\.adjust_lr_fn=match_rms_adamw, optimizer\.betas=\[0\.8, 0\.95\], "
                                            r"optimizer\.adamw_lr=[\d.]+: SGD takes no arguments 'adjust_lr_fn', 'betas', "
                                            rf"'adamw_lr' {TAKES_NO} Fix: ~optimizer\.adjust_lr_fn ~optimizer\.betas "
                                            r"~optimizer\.adamw_lr to drop them",
    "experiment=charlm_fast optimizer=adamw8bit": r"^optimizer\.adjust_lr_fn=match_rms_adamw, optimizer\.adamw_lr=[\d.]+, "
                                                 r"optimizer\.momentum=[\d.]+: AdamW8bit takes no arguments "
                                                 r"'adjust_lr_fn', 'adamw_lr', 'momentum' \(it takes: .*block_size.*\)"
                                                 r".*Fix: ~optimizer\.adjust_lr_fn ~optimizer\.adamw_lr ~optimizer\.momentum",
    "experiment=charlm_fast optimizer=adamw ~optimizer.adjust_lr_fn ~optimizer.adamw_lr ~optimizer.momentum "
    "optimizer.lr=0.003": None,  # runs
    "experiment=charlm_fast optimizer=sgd ~optimizer.adjust_lr_fn ~optimizer.betas ~optimizer.adamw_lr": None,
    "experiment=charlm_fast precision=32-true": None,
    "experiment=charlm_fast precision=bf16-mixed": None,
    # the preset's schedule is its own accumulation option (issue 50): another option replaces it whole
    "experiment=charlm_fast accumulation=none": None,
    "experiment=charlm_fast accumulation=fixed": None,
    "experiment=charlm_fast accumulation=fixed accumulation.effective_batch=[[0,12]]":
        r"AccumulationScheduler\(factors=\[\[0, 4\]\]\): give exactly one of factors=.* or effective_batch=",
}
TWO_STEPS = ["trainer.max_steps=2", "trainer.val_check_interval=1", "trainer.limit_val_batches=1", "logger=none",
             "validate=false", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


@pytest.mark.parametrize("command", list(PRESET_SWITCHES))
def test_switching_a_presets_component_runs_or_stops_in_one_line(make_cfg, command):
    overrides, message = command.split(), PRESET_SWITCHES[command]
    if message is None:
        preflight(overrides)
        summary = train(make_cfg([*overrides, *TWO_STEPS]))  # the optimizer is built at the first step
        assert summary["global_step"] == 2
        return
    with pytest.raises(ConfigError, match=message) as error:
        preflight(overrides)  # refusals of the config
        train(make_cfg([*overrides, *TWO_STEPS]))  # refusals of a component as it is built, before training
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(("overrides", "message"), [
    (["peft=lora", "peft.export_format=zip"], r"peft\.export_format='zip': PEFTAdapters\(export_format='zip'\): "
                                              r"must be one of auto, hf, state_dict\. Fix: export_format=auto"),
    (["callbacks=[activation_checkpointing]"], r"^callbacks\.activation_checkpointing\.modules=\['decoder-layers'\]: "
                                               r"ActivationCheckpointing\(modules=\['decoder-layers'\]\): modules=\["
                                               r"decoder-layers\]: MLPClassifier has no decoder layers .*Fix: name the "
                                               r"block class to checkpoint, e\.g\. modules=\[Block\]$"),
    (["peft=lora", "peft.target_modules=[qvk]"], r"peft\.target_modules=\['qvk'\]: PEFTAdapters\(target_modules="
                                                  r"\['qvk'\]\): 'qvk' matches no module name or class of "
                                                  r"MLPClassifier\. Module names: net, train_acc, val_acc\. Classes: "
                                                  r".*Linear.*Fix: "),
    (["peft=lora", "peft.r=0"], r"peft\.r=0: PEFTAdapters\(r=0\): the adapter rank must be an int >= 1"),
    (["peft=lora", "peft.method=prefix"], r"peft\.method='prefix': PEFTAdapters\(method='prefix'\): unknown method"),
    (["peft=head_only", "peft.trainable_modules=[]"], r"PEFTAdapters\(method=freeze\): nothing would train\. Fix: "
                                                      r"trainable_modules=\[last-linear\]"),
    # peft=none's export of the trained model (ExportModel): its values, and hf/ for a model that is not one
    (["peft.export=maybe"], r"^peft\.export='maybe': ExportModel\(export='maybe'\): one of auto, true, false\. Fix: "
                            r"export=auto"),
    (["peft=lora", "peft.export_dtype=fp8"], r"^peft\.export_dtype='fp8': PEFTAdapters\(export_dtype='fp8'\): must be "
                                              r"one of auto, float32, bfloat16, float16\. Fix: export_dtype=auto"),
    (["peft.export_dtype=half"], r"^peft\.export_dtype='half': ExportModel\(export_dtype='half'\): must be one of "
                                 r"auto, float32, bfloat16, float16\. Fix: export_dtype=auto"),
    (["peft.export_format=onnx"], r"^peft\.export_format='onnx': ExportModel\(export_format='onnx'\): must be one of "
                                  r"auto, hf, state_dict\. Fix: export_format=auto"),
    (["peft.export_format=hf"], r"^peft\.export_format='?hf'?: ExportModel\(export_format='hf'\): MLPClassifier holds no "
                                r"Hugging Face model .*Fix: export_format=auto"),
    (["peft.export=true", "peft.export_dir=/proc/lit_speed_cannot_write"],
     r"^peft\.export_dir=/proc/lit_speed_cannot_write: ExportModel\(export_dir=/proc/lit_speed_cannot_write\): the "
     r"trained model could not be written there after training"),
    (["init=weights", "init.path=/nonexistent/w.pt"], r"init\.path=/nonexistent/w\.pt: InitWeights\(path=/nonexistent"
                                                      r"/w\.pt\): no such file or folder\. Fix: "),
])
def test_fine_tuning_options_are_refused_before_training_naming_the_setting(make_cfg, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        train(make_cfg([*SHORT, *overrides]))
    assert not (tmp_path / "checkpoints").exists(), "a training step ran"


@pytest.mark.parametrize(("overrides", "message"), [
    (["callbacks=[chunked_loss]"], r"^callbacks\.chunked_loss: ChunkedLMLoss: MLPClassifier holds no Hugging Face causal "
                                   r"LM and has no use_chunked_loss\(chunk_bytes\) method .*Fix: drop chunked_loss"),
    (["callbacks=[return_freed_memory]", "callbacks.return_freed_memory.threshold_kib=0"],
     r"^callbacks\.return_freed_memory\.threshold_kib=0: ReturnFreedMemory\(threshold_kib=0\): an int in 1\.\.32768 "
     r".*Fix: threshold_kib=256$"),
    (["callbacks=[keep_freed_memory]", "callbacks.keep_freed_memory.min_available_fraction=0"],
     r"^callbacks\.keep_freed_memory\.min_available_fraction=0: KeepFreedMemory\(min_available_fraction=0\): a "
     r"fraction .*Fix: min_available_fraction=0\.15$"),
    (["callbacks=[default,keep_freed_memory,return_freed_memory]"],
     r"^callbacks: keep_freed_memory and return_freed_memory together: one keeps freed memory in the process for "
     r"speed, the other returns it to the system for memory\. Fix: keep one \(callbacks=\[default,keep_freed_memory\] "
     r"or callbacks=\[default,return_freed_memory\]\)$"),
    (["experiment=charlm_cpu", "callbacks=[chunked_loss]", "callbacks.chunked_loss.chunk_mib=0"],
     r"^callbacks\.chunked_loss\.chunk_mib=0: ChunkedLMLoss\(chunk_mib=0\): .*Fix: chunk_mib=auto"),
    (["experiment=charlm_cpu", "callbacks=[chunked_loss]", "callbacks.chunked_loss.chunk_mib=fast"],
     r"^callbacks\.chunked_loss\.chunk_mib='fast': ChunkedLMLoss\(chunk_mib='fast'\): .* or 'auto' .*Fix: "
     r"chunk_mib=auto"),
    # a bf16-held frozen base needs float32 module weights around it (the adapters) and no ZeRO
    (["peft=lora", "peft.base_dtype=fp16"], r"^peft\.base_dtype='fp16': PEFTAdapters\(base_dtype='fp16'\): .*Fix: "
                                            r"base_dtype=bf16"),
    (["peft=lora", "peft.base_dtype=bf16", "precision=bf16-true"],
     r"^peft\.base_dtype=bf16: PEFTAdapters\(base_dtype=bf16\): precision=bf16-true casts the whole module, adapters "
     r"included, to bf16 .*Fix: precision=32-true or bf16-mixed"),
    (["peft=lora", "peft.base_dtype=bf16", "precision=bf16-master"], r"precision=bf16-master casts the whole module"),
    (["peft=lora", "peft.base_dtype=int8", "precision=bf16-true"],
     r"^peft\.base_dtype=int8: PEFTAdapters\(base_dtype=int8\): precision=bf16-true casts the whole module"),
    (["peft=lora", "peft.base_dtype=int8", "strategy=zero2"], r"^peft\.base_dtype=int8: .*DeepSpeed ZeRO casts and "
                                                              r"partitions .*Fix: strategy=auto or ddp"),
    (["peft=lora", "peft.base_dtype=bf16", "precision=auto"], r"^peft\.base_dtype=bf16: .*precision=auto may choose "
                                                              r"bf16-master"),
    (["peft=lora", "peft.base_dtype=bf16", "strategy=zero2"], r"^peft\.base_dtype=bf16: .*DeepSpeed ZeRO casts and "
                                                              r"partitions .*Fix: strategy=auto or ddp"),    # LoRA's up-projection gradient: standard | transposed | auto
    (["peft=lora", "peft.up_grad=fast"], r"^peft\.up_grad='fast': PEFTAdapters\(up_grad='fast'\): one of auto, "
                                         r"standard, transposed\. Fix: up_grad=auto"),
])
def test_memory_levers_are_refused_before_training_naming_the_setting(make_cfg, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message) as error:
        train(make_cfg([*SHORT, *overrides]))
    assert "\n" not in str(error.value)


def test_resuming_adapters_without_the_peft_option_names_the_fix(make_cfg, tmp_path):
    train(make_cfg([*SHORT, "callbacks=model_checkpoint", "peft=lora"]))
    adapters = tmp_path / "checkpoints" / "last.ckpt"
    assert torch.load(adapters, weights_only=True)["adapters_only"] is True
    with pytest.raises(ConfigError, match=rf"ckpt_path={adapters}: holds adapters only .*Fix: the peft=/peft\.\* and "
                                          r"init= options of the run that wrote it"):
        train(make_cfg([*SHORT, "trainer.max_epochs=2", f"ckpt_path={adapters}"]))
    summary = train(make_cfg([*SHORT, "trainer.max_epochs=2", "peft=lora", f"ckpt_path={adapters}"]))
    assert summary["global_step"] == 4  # resumed: 2 more steps


# ---- issue 33 (checks): tracebacks, silent acceptances and misleading lines a new user met ----------------------
PREFLIGHT_CASES_33 = {
    # D: a key given from the top level that lives under a group named its full path
    "validation_budget.max_fraction=2": r"^validation_budget\.max_fraction=2: no key 'validation_budget' at the top "
                                        r"level; it is callbacks\.validation_budget\.max_fraction, which the callbacks "
                                        r"option validation_budget adds\. Fix: 'callbacks=\[default,validation_budget\]'"
                                        r" callbacks\.validation_budget\.max_fraction=2$",
    "lora.r=4": r"^lora\.r=4: no key 'lora' at the top level; lora is an option of the peft group\. Fix: peft=lora "
                r"peft\.r=4$",
}


@pytest.mark.parametrize("override", list(PREFLIGHT_CASES_33))
def test_a_nested_key_from_the_top_level_names_where_it_lives(override):
    with pytest.raises(ConfigError, match=PREFLIGHT_CASES_33[override]):
        preflight([override])


def test_the_named_home_of_a_nested_key_is_a_fix_that_composes():
    preflight(["callbacks=[default,validation_budget]", "callbacks.validation_budget.max_fraction=0.1"])
    preflight(["peft=lora", "peft.r=4"])


@pytest.mark.parametrize("text", ["_target_: foo\n  bad: [yaml\n", "_target_: a.b\nx: [1, 2\ny: 3\n"])
def test_an_own_config_file_that_is_not_yaml_names_the_option_the_file_and_the_line(tmp_path, text):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "broken.yaml").write_text(text)
    with pytest.raises(ConfigError, match=rf"^model=broken: {tmp_path}/model/broken\.yaml is not valid YAML \(.*, "
                                          r"line \d+, column \d+.*\)\. Fix: correct that line of the file"):
        preflight(["--config-dir", str(tmp_path), "model=broken"])


# override(s) -> the one line (each refused before the first training batch; the last column: what it used to do)
TRAIN_CASES_33 = {
    "data.batch_transform=foo": r"^data\.batch_transform='foo': DigitsDataModule\(batch_transform='foo'\): must be a "
                                r"function batch -> batch or None, got a str\. Fix: .*data\.batch_transform=\{_target_:",
    # (a TypeError at the first batch)
    "precision.threads=1000": r"^precision\.threads=1000: GuardedPrecision\(threads=1000\): more than the \d+ CPU "
                              r"core\(s\) this process may run on .*Fix: threads=\d+ \(or fewer\)",  # (ran 3.5x slower)
    "precision.attention=fast": r"^precision\.attention='fast': GuardedPrecision\(attention='fast'\): one of auto, "
                                r"math, flash, efficient, cudnn or None \(torch's pick\)\. Fix: attention=auto",
    "precision.attention=cudnn": r"^precision\.attention='cudnn': GuardedPrecision\(attention='cudnn'\): the cudnn "
                                 r"kernel is CUDA-only; this run trains on the CPU\. Fix: attention=math or flash",
    # (a RuntimeError "No available kernel" at the first forward)
    "accumulation=ramp accumulation.factors=null accumulation.effective_batch=[[0,100]]":
        r"^accumulation\.effective_batch=\{0: 100\}: AccumulationScheduler\(effective_batch=\{0: 100\}\): "
        r"effective_batch\[0\] = 100 is not divisible by micro_batch \(64\) x world size \(1\) = 64; use 64 or 128",
    # (trained at 64)
    "peft=lora +peft.options.use_foo=true": r"^peft\.options=\{'use_foo': True\}: PEFTAdapters\(options=\{'use_foo': "
                                            r"True\}\): 'use_foo' is not an argument of peft's LoraConfig\. Did you mean "
                                            r"use_dora\? It takes: .*use_rslora.*Fix: drop it \(~peft\.options\.use_foo\)",
    # (blamed peft.target_modules)
    "peft=lora +peft.options.lora_alpha=4": r"'lora_alpha' is PEFTAdapters' own argument 'alpha'.*Fix: peft\.alpha=4",
    "peft=lora +peft.options.init_lora_weights=foo": r"^peft\.options=.*peft refused init_lora_weights \(Unknown "
                                                     r"initialization.*Fix: .*~peft\.options\.init_lora_weights",
}


@pytest.mark.parametrize("command", list(TRAIN_CASES_33))
def test_issue_33_commands_stop_in_one_line_before_training(make_cfg, tmp_path, command):
    with pytest.raises(ConfigError, match=TRAIN_CASES_33[command]) as error:
        preflight(command.split())
        train(make_cfg([*command.split(), *SHORT, "callbacks=model_checkpoint"]))
    assert "\n" not in str(error.value)
    assert not (tmp_path / "checkpoints").exists(), "a training step ran"


def test_an_export_folder_that_cannot_be_written_is_refused_before_training(make_cfg, tmp_path):
    # (was a FileNotFoundError at the merged export, after training)
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError, match=rf"^peft\.export_dir={tmp_path}/a_file/merged: PEFTAdapters\(export_dir="
                                          r".*\): the merged model could not be written there after training \(Not a "
                                          r"directory: .*\)\. Fix: export_dir=<a folder you can write to> "
                                          r"\(peft\.export_dir=\.\.\.\), or export=false"):
        train(make_cfg([*SHORT, "callbacks=model_checkpoint", "peft=lora", f"peft.export_dir={tmp_path}/a_file/merged"]))
    assert not (tmp_path / "checkpoints").exists(), "a training step ran"


@pytest.fixture
def other_model_weights(tmp_path):
    """A state_dict of another model that shares one tensor (name and shape) with the MLP: its first layer."""
    mlp = MLPClassifier()
    first = next(k for k in mlp.state_dict() if k.endswith("weight"))
    path = tmp_path / "other.pt"
    torch.save({first: mlp.state_dict()[first].clone(), "encoder.layers.0.weight": torch.zeros(3, 3),
                "encoder.layers.1.weight": torch.zeros(3, 3)}, path)
    return path, len(mlp.state_dict())


def test_init_weights_of_another_model_says_how_many_match_and_does_not_suggest_strict_false(make_cfg,
                                                                                             other_model_weights):
    path, n = other_model_weights
    with pytest.raises(ConfigError, match=rf"^init\.path={path}: InitWeights\(path={path}\): only 1 of MLPClassifier's "
                                          rf"{n} tensors match the file's 3 by name and shape: it holds another model "
                                          r".*Fix: weights written by this model") as error:
        train(make_cfg([*SHORT, "init=weights", f"init.path={path}"]))
    assert "strict=false" not in str(error.value)


def test_init_weights_of_another_model_with_strict_false_warns_that_most_train_from_random(make_cfg,
                                                                                           other_model_weights):
    path, n = other_model_weights
    with pytest.warns(UserWarning, match=rf"only 1 of the model's {n} tensors were in the file; the rest trains from "
                                         "its random initialisation"):
        train(make_cfg([*SHORT, "init=weights", f"init.path={path}", "init.strict=false"]))
