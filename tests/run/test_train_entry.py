"""scripts/train.py end to end: default run quality, experiments, multirun, bad input."""
from __future__ import annotations

import json

import pytest

from lit_speed.run.config_check import preflight
from lit_speed.run.config_error import ConfigError
from lit_speed.run.runner import train
from tests.helpers.repo import CONF, run_train_script

EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
# a preset that pretrains its start when it is missing does so here in 4 steps, into this test's folder
SHRUNK_PRETRAINING = {"charlm_finetune": lambda tmp: [
    f"init.path={tmp}/pretrained.ckpt", "init.pretrain=['experiment=charlm_fast','trainer.max_steps=4',"
    "'trainer.val_check_interval=2','callbacks=[model_checkpoint]','logger=none','validate=false']"]}


def test_default_digits_run_reaches_95_percent(make_cfg, tmp_path):
    summary = train(make_cfg(["logger=none"]))
    assert summary["final_val"]["val/acc"] >= 0.95, summary["final_val"]
    assert summary["global_step"] == 20 * 23  # 20 epochs x ceil(1438 / 64) batches
    assert summary["samples"] == 20 * 1438
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["final_val"] == summary["final_val"]
    assert written["config"]["data"]["_target_"].endswith("DigitsDataModule")


@pytest.mark.slow  # 10-28 s: the default tier stays near 10 minutes on 2 cores
def test_charlm_beats_unigram_baseline_in_200_steps(make_cfg):
    summary = train(make_cfg(["experiment=charlm_cpu", "trainer.max_steps=200", "logger=none", "callbacks=none"]))
    val_loss = summary["final_val"]["val/loss"]
    print(f"val/loss {val_loss:.4f} vs unigram baseline {summary['unigram_baseline']:.4f}")
    assert val_loss < summary["unigram_baseline"]
    assert summary["tokens"] == 200 * 12 * 64


#: presets that need a model folder built first (benchmarks/model_folders.py): slow tier, skipped without the folder
NEEDS_FOLDER = {"finetune_1b_lora": CONF.parent / ".cache" / "model_folders" / "llama-3.2-1b",
                "sft_lora": CONF.parent / ".cache" / "model_folders" / "qwen2.5-0.5b"}


def _preset(name: str) -> object:
    folder = NEEDS_FOLDER.get(name)
    if folder is None:
        return name
    return pytest.param(name, marks=[pytest.mark.slow, pytest.mark.skipif(
        not (folder / "config.json").is_file(), reason=f"needs {folder} (python benchmarks/model_folders.py "
                                                       f"{folder.name}: a 2.5 GB folder, minutes to build)")])


@pytest.mark.parametrize("experiment", [None, *map(_preset, EXPERIMENTS)])
def test_train_script_fast_dev_run(tmp_path, experiment):
    args = ["trainer.fast_dev_run=true", f"hydra.run.dir={tmp_path}"]
    if experiment:
        args[:0] = [f"experiment={experiment}", *SHRUNK_PRETRAINING.get(experiment, lambda _: [])(tmp_path / "start")]
    # the 1B preset's one step at 4 x 512 tokens: 351 s from launch to the merged export on a 2-core Zen3 (training
    # 195 s, validation 67, fit check 45, export 25); 300 s stopped it there
    result = run_train_script(args, timeout=900 if experiment in NEEDS_FOLDER else 300)
    assert result.returncode == 0, result.stderr[-3000:]
    if experiment in SHRUNK_PRETRAINING:  # pretrained (4 steps), then loaded strictly before the fine-tuning step
        assert (tmp_path / "start" / "pretrained.ckpt").is_file()
        assert "pretrained.ckpt (lightning checkpoint): 28/28 tensors, strict" in result.stdout + result.stderr
        assert "trainable parameters" in result.stdout and "65,536 of 873,728" in result.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["global_step"] == 1
    assert "lit_speed run" in result.stdout and "effective batch" in result.stdout


def test_multirun_writes_one_summary_per_job(tmp_path):
    result = run_train_script(["-m", "precision=32-true,bf16-mixed", "trainer.fast_dev_run=true",
                               f"hydra.sweep.dir={tmp_path}"])
    assert result.returncode == 0, result.stderr[-3000:]
    precisions = sorted(json.loads((tmp_path / str(i) / "summary.json").read_text())["startup"]["precision"]
                        for i in range(2))
    assert len(precisions) == 2 and precisions[0] != precisions[1]


@pytest.mark.parametrize(("override", "must_name"), [
    ("precision=fp8", ["fp8", "precision", "32-true", "bf16-mixed", "16-mixed"]),
    ("strategy=zero4", ["zero4", "zero1", "zero2_offload"]),
    ("trainer.max_step=5", ["max_step", "trainer.max_steps", "+trainer.max_step=5"]),
    ("data.batchsize=8", ["batchsize", "data.batch_size"]),
])
def test_preflight_names_bad_value_and_choices(override, must_name):
    with pytest.raises(ConfigError) as info:
        preflight([override])
    for word in must_name:
        assert word in str(info.value), f"{word!r} missing from: {info.value}"


def test_preflight_checks_the_first_value_of_a_sweep():
    with pytest.raises(ConfigError, match="unknown option 'fp8' for group 'precision'"):
        preflight(["-m", "precision=fp8,32-true"])
    preflight(["-m", "precision=32-true,bf16-mixed", "hydra.sweep.dir=/tmp/x"])  # valid: no error


@pytest.mark.slow  # 10-28 s: the default tier stays near 10 minutes on 2 cores
def test_unknown_option_exits_with_one_clear_message(tmp_path):
    result = run_train_script(["precision=fp8", f"hydra.run.dir={tmp_path}"], timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "unknown option 'fp8' for group 'precision'. Valid choices:" in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 3, result.stderr


def test_component_value_error_is_reported_without_hydra_wrapper(tmp_path):
    result = run_train_script(["data.batch_size=0", f"hydra.run.dir={tmp_path}"], timeout=120)
    assert result.returncode != 0
    assert "data.batch_size=0: DigitsDataModule(batch_size=0): batch_size must be >= 1, got 0" in result.stderr


@pytest.mark.parametrize(("override", "message"), [
    ("trainer.max_epochs=abc", r"trainer\.max_epochs='abc': Trainer expects int or null, got str"),
    ("trainer.max_steps=1.5", r"trainer\.max_steps=1\.5: Trainer expects int, got float"),
    ("trainer.deterministic=maybe", r"trainer\.deterministic='maybe': Trainer expects bool or 'warn' or null"),
    ("trainer.enable_progress_bar=3", r"trainer\.enable_progress_bar=3: Trainer expects bool or null, got int"),
])
def test_preflight_refuses_wrong_trainer_types(override, message):
    with pytest.raises(ConfigError, match=message):
        preflight([override])


@pytest.mark.parametrize("override", ["trainer.max_epochs=null", "trainer.gradient_clip_val=1", "trainer.devices=2",
                                      "trainer.val_check_interval=0.5", "trainer.deterministic=warn"])
def test_preflight_accepts_valid_trainer_values(override):
    preflight([override])


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_charlm_finetune_preset_runs_end_to_end_from_nothing(tmp_path):
    """The README's one command on a machine with no cached weights or corpus: pretraining (charlm_fast, shortened
    from 450 to 100 steps) then LoRA fine-tuning on Lightning's source (shortened to 40 steps), adapters-only
    checkpoints, merged export."""
    pretrain = ["experiment=charlm_fast", "trainer.max_steps=100", "callbacks=[model_checkpoint]", "logger=none",
                "validate=false", "data.root=null"]
    result = run_train_script(["experiment=charlm_finetune", "trainer.max_steps=40", "trainer.val_check_interval=20",
                               "init.pretrain=[" + ",".join(f"'{o}'" for o in pretrain) + "]",
                               f"hydra.run.dir={tmp_path / 'run'}"], env={"LIT_SPEED_CACHE": str(tmp_path / "cache")},
                              timeout=1700)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "cache" / "charlm_finetune" / "pretrained.ckpt").is_file()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["startup"]["trainable parameters"].startswith("65,536 of 873,728")
    assert summary["global_step"] == 40 and summary["final_val"]["val/loss"] < summary["unigram_baseline"]
    assert (tmp_path / "run" / "merged" / "model.pt").is_file()
