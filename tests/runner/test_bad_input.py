"""The bad-input matrix, in process: every command line that cannot train is refused with a message naming the fix.

Config-only cases go through :func:`preflight` (what ``scripts/train.py`` runs first, no model built); cases that
need the built model or the Trainer go through :func:`train`. ``tests/checkpointing/test_faults_config.py`` runs
the same cases through the real entry point (exit code 2, one ``Config error:`` line).
"""
from __future__ import annotations

import json

import pytest
import torch

from lit_speed.config_check import ConfigError, preflight
from lit_speed.models.gpt import GPTModule
from lit_speed.run_checks import check_activation_memory
from lit_speed.runner import build, train
from tests.helpers.repo import CONF

DATA = sorted(p.stem for p in (CONF / "data").glob("*.yaml"))
MODELS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
MATCHING = {"digits": "mlp", "digits_curriculum": "mlp", "charlm": "gpt", "charlm_curriculum": "gpt",
            "text_folder": "hf_causal_lm"}
# what a pair needs besides the two options (a required value each): a tiny HF folder is made by the test that builds
PAIR_VALUES = {"text_folder": ["model.pretrained=/path/to/hf_folder", "data.root=/path/to/texts"]}
SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "logger=none",
         "validate=false", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


def test_every_data_option_has_a_matching_model():
    assert sorted(MATCHING) == DATA, "a new data option: say which model it feeds (and in run_checks.DATA_MODEL)"


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("data", DATA)
def test_data_model_pair_builds_or_is_refused_naming_both_fixes(make_cfg, tmp_path, data, model):
    overrides = [f"data={data}", f"model={model}"]
    if MATCHING[data] == model:
        if data in PAIR_VALUES:
            from tests.helpers.tiny_hf import STDLIB, save_tiny_causal_lm

            folder = save_tiny_causal_lm(tmp_path / "hf")
            overrides += [f"model.pretrained={folder}", f"data.root={STDLIB / 'json'}"]
        preflight(overrides)
        parts = build(make_cfg(overrides))
        assert type(parts["model"]).__name__ == {"mlp": "MLPClassifier", "gpt": "GPTModule",
                                                 "hf_causal_lm": "HFCausalLM"}[model]
        return
    with pytest.raises(ConfigError, match=rf"does not fit model={model} .*Fix: data=digits model=mlp, "
                                          r"or experiment=charlm_cpu \(data=charlm model=gpt\)"):
        preflight(overrides)


@pytest.mark.parametrize("overrides", [["data=charlm"], ["data=charlm_curriculum"], ["model=gpt"]])
def test_a_single_data_or_model_option_is_refused_before_anything_starts(overrides):
    with pytest.raises(ConfigError, match="does not fit model=.*Fix: "):
        preflight(overrides)


@pytest.mark.parametrize("strategy", ["zero2_offload", "zero3_offload"])
def test_offload_selects_cpu_adam_keeping_lr_and_betas(make_cfg, strategy):
    cfg = make_cfg([f"strategy={strategy}", "optimizer.lr=0.02", "optimizer.betas=[0.8,0.9]"])
    assert cfg.optimizer._target_ == "lit_speed.strategies.cpu_adam.CPUAdam"
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
    "trainer.max_epochs=0": r"trainer\.max_epochs=0: the run would make no optimizer step\. Fix",
    "trainer.limit_train_batches=0": r"trainer\.limit_train_batches=0: the run would make no optimizer step\. Fix",
    "data.batch_size=abc": r"data\.batch_size='abc': DigitsDataModule expects int, got str\. Fix: data\.batch_size=",
    "model.hidden=abc": r"model\.hidden='abc': MLPClassifier expects int, got str\. Fix: model\.hidden=",
    "seed=abc": r"seed='abc': expected an integer or null\. Fix: seed=42",
    "init=weights": r"init\.path=\?\?\?: required, and not given\. Fix: init\.path=<a value>",
    "model=hf_causal_lm": r"does not fit model=hf_causal_lm .*Fix: .*data=text_folder model=hf_causal_lm "
                          r"model\.pretrained=<folder> data\.root=<texts>",
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


@pytest.mark.slow  # the first use JIT-builds DeepSpeed's CPU Adam (~2 min, then cached)
def test_offload_option_alone_runs_with_cpu_adam(tmp_path):
    from tests.helpers.repo import run_train_script

    result = run_train_script(["strategy=zero2_offload", "trainer.fast_dev_run=true", f"hydra.run.dir={tmp_path}"],
                              timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["global_step"] == 1
    assert summary["config"]["optimizer"]["_target_"] == "lit_speed.strategies.cpu_adam.CPUAdam"
    assert summary["startup"]["zero"].startswith("stage 2, offload: optimizer")


@pytest.mark.parametrize(("overrides", "message"), [
    (["peft=lora", "peft.target_modules=[qvk]"], r"peft\.target_modules=\['qvk'\]: PEFTAdapters\(target_modules="
                                                  r"\['qvk'\]\): 'qvk' matches no module name or class of "
                                                  r"MLPClassifier\. Module names: net, train_acc, val_acc\. Classes: "
                                                  r".*Linear.*Fix: "),
    (["peft=lora", "peft.r=0"], r"peft\.r=0: PEFTAdapters\(r=0\): the adapter rank must be an int >= 1"),
    (["peft=lora", "peft.method=prefix"], r"peft\.method='prefix': PEFTAdapters\(method='prefix'\): unknown method"),
    (["peft=head_only", "peft.trainable_modules=[]"], r"PEFTAdapters\(method=freeze\): nothing would train\. Fix: "
                                                      r"trainable_modules=\[last-linear\]"),
    (["init=weights", "init.path=/nonexistent/w.pt"], r"init\.path=/nonexistent/w\.pt: InitWeights\(path=/nonexistent"
                                                      r"/w\.pt\): no such file or folder\. Fix: "),
])
def test_fine_tuning_options_are_refused_before_training_naming_the_setting(make_cfg, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        train(make_cfg([*SHORT, *overrides]))
    assert not (tmp_path / "checkpoints").exists(), "a training step ran"


def test_resuming_adapters_without_the_peft_option_names_the_fix(make_cfg, tmp_path):
    train(make_cfg([*SHORT, "callbacks=model_checkpoint", "peft=lora"]))
    adapters = tmp_path / "checkpoints" / "last.ckpt"
    assert torch.load(adapters, weights_only=True)["adapters_only"] is True
    with pytest.raises(ConfigError, match=rf"ckpt_path={adapters}: holds adapters only .*Fix: the peft=/peft\.\* and "
                                          r"init= options of the run that wrote it"):
        train(make_cfg([*SHORT, "trainer.max_epochs=2", f"ckpt_path={adapters}"]))
    summary = train(make_cfg([*SHORT, "trainer.max_epochs=2", "peft=lora", f"ckpt_path={adapters}"]))
    assert summary["global_step"] == 4  # resumed: 2 more steps
