"""peft=none's ExportModel: what it exports after fit and when, and what it refuses before training.

The full fine-tune of a Hugging Face model (its save_pretrained folder holding the trained weights) is tested in
tests/models/test_hf_causal_lm.py; the refusals through the runner are rows of tests/run/test_bad_input.py.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lit_speed.finetune.export_callback import ExportModel
from lit_speed.models.mlp import MLPClassifier
from lit_speed.run.runner import train

SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "logger=none",
         "validate=false", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


class DeepSpeedStrategy:
    """Stands in for Lightning's: strategy_facts reads the class name and the ZeRO stage of its config."""

    def __init__(self, stage: int) -> None:
        self.config = {"zero_optimization": {"stage": stage}}


def _trainer(tmp_path, strategy=None):
    return SimpleNamespace(strategy=strategy, is_global_zero=True, default_root_dir=str(tmp_path), interrupted=False,
                           datamodule=None)


def test_a_bundled_model_under_auto_exports_nothing_and_says_its_checkpoint_is_the_result(make_cfg, tmp_path):
    summary = train(make_cfg(SHORT))  # peft=none is the default: every parameter trains
    export = summary["components"]["ExportModel"]
    assert export["exported"] == {} and export["export_s"] is None and not (tmp_path / "model").exists()
    assert export["reason"].startswith("none: the checkpoint is the result (peft.export=true")


def test_export_true_writes_a_state_dict_that_loads_into_a_plain_model_with_the_trained_weights(make_cfg, tmp_path):
    summary = train(make_cfg([*SHORT, "peft.export=true", "callbacks=[model_checkpoint]"]))
    assert summary["components"]["ExportModel"]["exported"] == {"state_dict": str(tmp_path / "model" / "model.pt")}
    state = torch.load(tmp_path / "model" / "model.pt", weights_only=True)
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert state.keys() == ckpt.keys()
    assert all(torch.equal(state[k], ckpt[k]) for k in state)
    plain = MLPClassifier()
    plain.load_state_dict(state)  # strict: every key, nothing more


def test_unknown_values_are_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"ExportModel\(export='yes'\): one of auto, true, false\. Fix: export=auto"):
        ExportModel(export="yes")
    with pytest.raises(ValueError, match=r"ExportModel\(export_format='zip'\): must be one of auto, hf, state_dict"):
        ExportModel(export_format="zip")


def test_under_zero3_auto_skips_and_says_why_and_true_is_refused_before_training(tmp_path):
    module = MLPClassifier()
    auto = ExportModel()
    auto.setup(_trainer(tmp_path, DeepSpeedStrategy(3)), module, "fit")
    assert auto.active is False and auto.describe() == {
        "export": "trained model: not under ZeRO-3 (scripts/consolidate.py writes the whole model)"}
    with pytest.raises(ValueError, match=r"ExportModel\(export=True\): cannot export under ZeRO stage 3 .*Fix: "
                                         r"peft\.export=auto"):
        ExportModel(export=True).setup(_trainer(tmp_path, DeepSpeedStrategy(3)), module, "fit")
    zero2 = ExportModel(export=True)
    zero2.setup(_trainer(tmp_path, DeepSpeedStrategy(2)), module, "fit")  # every process holds the whole model
    assert zero2.active is True


def test_nothing_is_exported_after_an_interrupted_fit_or_on_other_ranks(tmp_path):
    module = MLPClassifier()
    callback = ExportModel(export=True)
    trainer = _trainer(tmp_path)
    callback.setup(trainer, module, "fit")
    trainer.interrupted = True
    callback.on_fit_end(trainer, module)
    assert callback.exported == {} and not (tmp_path / "model" / "model.pt").exists()
    trainer.interrupted, trainer.is_global_zero = False, False
    callback.on_fit_end(trainer, module)
    assert callback.exported == {} and not (tmp_path / "model" / "model.pt").exists()
    trainer.is_global_zero = True
    callback.on_fit_end(trainer, module)
    assert (tmp_path / "model" / "model.pt").is_file() and callback.phase_seconds()["export"] > 0


def test_the_startup_table_says_what_auto_will_do_before_setup_and_what_it_does_after(tmp_path):
    callback = ExportModel(export_dir=str(tmp_path / "out"))
    assert callback.describe() == {"export": f"trained model: after fit, if a Hugging Face model (save_pretrained "
                                             f"folder in {tmp_path / 'out'}/hf)"}
    callback.setup(_trainer(tmp_path), MLPClassifier(), "fit")
    assert callback.describe()["export"].startswith("trained model: none: the checkpoint is the result")
    assert ExportModel(export=False).describe() == {"export": "trained model: off (peft.export=false)"}


def test_the_startup_table_has_no_export_row_for_a_model_auto_does_not_export(make_cfg):
    # issue 50: a bundled-MLP run's table said "trained model: after fit, if a Hugging Face model (...)"
    from lit_speed.run.runner import build
    from lit_speed.run.startup_table import startup_rows

    callback = ExportModel()
    callback.prepare_model(MLPClassifier())  # the runner calls it before the table
    assert callback.describe() == {}
    explicit = ExportModel(export=True)
    explicit.prepare_model(MLPClassifier())
    assert explicit.describe() == {"export": "trained model: after fit, to <run folder>/model"}
    parts = build(make_cfg(["logger=none"]))
    assert "export" not in startup_rows(parts["cfg"], parts)
