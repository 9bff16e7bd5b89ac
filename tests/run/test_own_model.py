"""A user's own model and config folder through every Hydra door (``examples/own_model``).

The pre-flight composes from the folders Hydra will search (``--config-dir``, ``hydra.searchpath``,
``--config-path``/``--config-name``, a ``model._target_`` override), refuses a typo in the user's groups naming the
near option among the user's and lit_speed's, and the example README's own command trains the foreign model with
precision, accumulation, ZeRO, checkpoints and the stats logger, ending with a non-zero MFU in the summary.
"""
from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

import pytest

from lit_speed.run.config_check import preflight
from lit_speed.run.config_error import ConfigError
from tests.helpers.repo import ROOT, run_train_script

EXAMPLE = ROOT / "examples" / "own_model"
CONF = EXAMPLE / "conf"
PAIR = ["model=residual_mlp", "data=teacher"]
# a few micro-batches per epoch, so validation (and the monitor's choice) happens within a short run
SHORT = ["trainer.max_epochs=-1", "trainer.max_steps=12", "trainer.limit_train_batches=6", "trainer.limit_val_batches=2",
         "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


FOREIGN = '''
from my_project.regressor import ResidualMLPRegressor


class WiderRegressor(ResidualMLPRegressor):
    """A subclass with the same arguments: a plain model._target_= swap."""


class OwnOptimizerRegressor(ResidualMLPRegressor):
    """Takes no optimizer argument: its configure_optimizers builds its own."""

    def __init__(self, in_features: int = 32, width: int = 256, depth: int = 3) -> None:
        super().__init__(in_features, width, depth)
'''


@pytest.fixture
def importable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``my_project`` importable in this process, as ``PYTHONPATH=examples/own_model`` makes it for the script, and
    ``foreign_models`` (two subclasses of the example's model) beside it."""
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "foreign_models.py").write_text(FOREIGN)
    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.syspath_prepend(str(tmp_path / "foreign"))


def documented_command() -> tuple[dict[str, str], list[str]]:
    """The example README's command: its environment assignments and the arguments after ``scripts/train.py``."""
    text = (EXAMPLE / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1).replace("\\\n", " ")
    words = shlex.split(block)
    env = dict(w.split("=", 1) for w in words[:words.index("python")])
    return env, words[words.index("scripts/train.py") + 1:]


# ---- the pre-flight sees what Hydra sees ---------------------------------------------------------------------

@pytest.mark.parametrize("door", [["--config-dir", str(CONF)], [f"--config-dir={CONF}"],
                                  [f"hydra.searchpath=[file://{CONF}]"]], ids=["config-dir", "config-dir=", "searchpath"])
def test_preflight_composes_the_users_groups_through_each_door(importable, door):
    cfg = preflight([*door, *PAIR, "precision=bf16-mixed", "strategy=zero2", "accumulation=ramp"])
    assert cfg.model._target_ == "my_project.regressor.ResidualMLPRegressor"
    assert cfg.data._target_ == "my_project.teacher_data.TeacherDataModule"
    assert cfg.model.in_features == 32 and cfg.strategy.stage == 2


def test_without_the_door_the_users_option_is_unknown(importable):
    with pytest.raises(ConfigError, match=r"^model=residual_mlp: unknown option 'residual_mlp' for group 'model'\. "
                                          r"Valid choices: gpt, hf_causal_lm, mlp\.$"):
        preflight(PAIR)


def test_relative_searchpath_is_relative_to_the_working_folder(importable, monkeypatch):
    monkeypatch.chdir(ROOT)
    preflight(["hydra.searchpath=[file://examples/own_model/conf]", *PAIR])


def test_own_primary_config_through_config_path_and_config_name(importable, tmp_path):
    (tmp_path / "mine.yaml").write_text(
        "defaults:\n  - train\n  - override model: residual_mlp\n  - override data: teacher\n  - _self_\n"
        f"hydra:\n  searchpath: [file://{ROOT / 'conf'}, file://{CONF}]\ntrainer:\n  max_epochs: 2\n")
    cfg = preflight(["--config-path", str(tmp_path), "--config-name", "mine", "precision=bf16-mixed"])
    assert cfg.model._target_.endswith("ResidualMLPRegressor") and cfg.trainer.max_epochs == 2
    with pytest.raises(ConfigError, match=r"^precision=fp9: unknown option 'fp9' for group 'precision'"):
        preflight(["--config-path", str(tmp_path), "--config-name", "mine", "precision=fp9"])


def test_a_target_override_passes_when_the_class_takes_the_keys(importable):
    preflight(["--config-dir", str(CONF), *PAIR, "model._target_=foreign_models.WiderRegressor"])


@pytest.mark.parametrize(("typo", "near"), [("model=residual_mpl", "model=residual_mlp"), ("data=teachr", "data=teacher")])
def test_a_typo_in_the_users_group_names_the_near_option_and_lists_the_users_options(importable, typo, near):
    group, _, value = typo.partition("=")
    with pytest.raises(ConfigError) as error:
        preflight(["--config-dir", str(CONF), *[p for p in PAIR if not p.startswith(group)], typo])
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"{typo}: unknown option '{value}' for group '{group}'. Valid choices: ")
    assert f"(yours: {near.split('=')[1]} from {CONF})" in message and message.endswith(f"Did you mean {near}?")
    assert ("gpt, hf_causal_lm, mlp" if group == "model" else "digits") in message  # lit_speed's own options beside the user's


def test_a_misspelt_group_name_is_named(importable):
    with pytest.raises(ConfigError, match=r"^modle=residual_mlp: no key 'modle' in the top level\. Did you mean "
                                          r"model=residual_mlp\?"):
        preflight(["--config-dir", str(CONF), "data=teacher", "modle=residual_mlp"])


# command line -> the one line the pre-flight refuses it with (the setting and the fix)
REFUSALS = {
    "data=teacher model._target_=my_project.regressor.ResidualMLPRegressor":  # mlp's keys stay with the new class
        r"^model\.num_classes=10, model\.hidden=256, model\.dropout=0\.1, model\.weight_decay=0\.0, "
        r"model\.scheduler=None: ResidualMLPRegressor takes no arguments 'num_classes', 'hidden', 'dropout', "
        r"'weight_decay', 'scheduler' \(it takes: depth, in_features, optimizer, width\).*Fix: ~model\.num_classes "
        r"~model\.hidden ~model\.dropout ~model\.weight_decay ~model\.scheduler to drop them, or model=<mlp> "
        r"\(takes them\)$",
    "model=residual_mlp data=charlm":  # a pair that does not fit, from what the classes declare
        r"^data \(CharLMDataModule\) does not fit model \(ResidualMLPRegressor\): it yields 'tokens->next-token' "
        r"batches, ResidualMLPRegressor takes 'features->value'\. Fix: model=gpt, or data=teacher",
    "model=residual_mlp data=teacher optimizer=sgd model._target_=foreign_models.OwnOptimizerRegressor":
        r"^optimizer=sgd: the model would not use it: OwnOptimizerRegressor takes no `optimizer` argument .*Fix: "
        r"drop optimizer=sgd",
    "model=residual_mlp data=teacher model._target_=missing_project.Model":
        r"^model\._target_=missing_project\.Model: cannot import it \(no module named 'missing_project'\)\. Fix: "
        r".*PYTHONPATH=<the folder that holds missing_project/>",
}


@pytest.mark.parametrize("command", list(REFUSALS))
def test_the_preflight_refuses_a_foreign_config_in_one_line_naming_the_fix(importable, command):
    with pytest.raises(ConfigError, match=REFUSALS[command]) as error:
        preflight(["--config-dir", str(CONF), *command.split()])
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(("argv", "message"), [
    (["--config-dir", "nope", *PAIR], r"^--config-dir nope: no such folder .*Fix: --config-dir <the folder"),
    (["data=teacher", "--config-dir", str(CONF), "model=residual_mlp"],
     rf"^model=residual_mlp: Hydra refuses it \(unrecognized arguments\).*Fix: python scripts/train.py --config-dir "
     rf"{CONF} data=teacher model=residual_mlp$"),
])
def test_hydra_flags_the_preflight_refuses_as_hydra_would(importable, argv, message):
    with pytest.raises(ConfigError, match=message):
        preflight(argv)


@pytest.mark.slow  # 10-28 s: the default tier stays near 10 minutes on 2 cores
def test_the_command_without_pythonpath_stops_in_one_line_naming_the_fix(tmp_path):
    _, args = documented_command()
    proc = run_train_script([*args, f"hydra.run.dir={tmp_path}"], timeout=300)  # no PYTHONPATH: not importable
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == ("Config error: data._target_=my_project.teacher_data.TeacherDataModule: cannot "
                                   "import it (no module named 'my_project'). Fix: make your package importable where "
                                   "the run starts: pip install -e <your project>, or PYTHONPATH=<the folder that "
                                   "holds my_project/> python scripts/train.py ...")


# ---- the documented command trains the foreign model ---------------------------------------------------------

def _run(tmp_path: Path, door: list[str], extra: list[str]):
    env, args = documented_command()
    args = [a for a in args if not a.startswith("--config-dir") and a != "examples/own_model/conf"]
    env = {k: str(ROOT / v) if k == "PYTHONPATH" else v for k, v in env.items()}
    keys = {e.split("=")[0] for e in extra}
    short = [s for s in SHORT if s.split("=")[0] not in keys]  # later lists win: each key is given once
    keys |= {s.split("=")[0] for s in short}
    args = [a for a in args if a.split("=")[0] not in keys]
    proc = run_train_script([*door, *args, *short, *extra, f"hydra.run.dir={tmp_path}"], timeout=600,
                            env={**env, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads((tmp_path / "summary.json").read_text())


def test_the_readme_command_is_the_acceptance_command():
    env, args = documented_command()
    assert env == {"PYTHONPATH": "examples/own_model"}
    assert args[:2] == ["--config-dir", "examples/own_model/conf"]
    assert {"model=residual_mlp", "data=teacher", "precision=bf16-mixed", "strategy=zero2", "accumulation=ramp"} <= set(args)


def _assert_trained_with_every_component(proc, summary, run_dir: Path) -> None:
    startup = summary["startup"]
    assert startup["model"].startswith("ResidualMLPRegressor: 798,977 parameters")
    assert startup["zero"].startswith("stage 2") and "bf16-mixed" in startup["zero precision"]
    # accumulation=ramp counts micro-batches per step (1 -> 4 of the teacher data's 64: 64 -> 256 samples per step)
    assert startup["accumulation"].startswith("factors {0: 1, 50: 4} by step")
    assert summary["monitor"] == "val/mse" and summary["best_val"] is not None  # chosen from the logged metrics
    assert summary["global_step"] == 12
    stats = summary["components"]["DeviceStatsLogger"]
    assert stats["flops_per_batch"] > 0 and stats["evidence"]["mfu"] > 0  # counted on the foreign model's step
    assert re.search(r"compute \(MFU\)\s+[\d.]+ [GT]FLOP/s, MFU [\d.]+%", proc.stdout)
    assert "lit_speed bottleneck" in proc.stdout and (run_dir / "bottleneck.json").exists()
    assert (run_dir / "checkpoints" / "last.ckpt").is_dir()  # DeepSpeed's checkpoint folder


@pytest.mark.slow  # DeepSpeed start-up: ~25 s on 2 cores
@pytest.mark.parametrize("door", ["config-dir", "searchpath"])
def test_documented_command_trains_the_foreign_model_with_every_component(tmp_path, door):
    chosen = ["--config-dir", str(CONF)] if door == "config-dir" else [f"hydra.searchpath=[file://{CONF}]"]
    proc, summary = _run(tmp_path, chosen, [])
    _assert_trained_with_every_component(proc, summary, tmp_path)
    if door == "config-dir":  # and resumes from its checkpoint
        proc, resumed = _run(tmp_path, chosen, ["ckpt_path=last", "trainer.max_steps=16"])
        assert resumed["global_step"] == 16 and resumed["best_val"] <= summary["best_val"]
        assert resumed["monitor"] == "val/mse"  # the first run's choice, from the checkpoint
        assert "callbacks used to create the checkpoint need to be provided" not in proc.stdout + proc.stderr


def test_foreign_model_trains_through_config_dir_with_precision_and_accumulation(tmp_path):
    """The default tier's run of the door: the same command without ZeRO (DeepSpeed's start-up is the slow part)."""
    proc, summary = _run(tmp_path, ["--config-dir", str(CONF)], ["strategy=auto", "trainer.max_steps=6"])
    assert summary["startup"]["precision"].startswith("bf16-mixed") and summary["global_step"] == 6
    assert summary["monitor"] == "val/mse" and summary["components"]["DeviceStatsLogger"]["evidence"]["mfu"] > 0
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    assert os.path.getsize(tmp_path / "csv" / "metrics.csv") > 0
