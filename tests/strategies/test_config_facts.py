"""``lit_speed.config_facts``: what a composed config runs, each class located by importing its ``_target_`` (issue
51): presets and options read right, and a renamed or subclassed component is still recognised."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from lit_speed import ActivationCheckpointing, PEFTAdapters, config_facts
from lit_speed.strategies.config_facts import StrategyLayout, is_a
from tests.helpers.repo import compose_config


class RenamedCheckpointing(ActivationCheckpointing):
    """A user's subclass with a name that does not end like lit_speed's."""


class RenamedAdapters(PEFTAdapters):
    """A user's subclass of the adapters."""


def test_the_default_config(tmp_path) -> None:
    facts = config_facts(compose_config([], tmp_path))
    assert (facts.precision_mode, facts.precision_plugin, facts.processes) == ("32-true", True, 1)
    assert facts.strategy == StrategyLayout(name="auto")
    assert not (facts.hf_model or facts.text_folder or facts.lora or facts.checkpointing)
    assert facts.adapters is None and facts.chunked_loss is None and facts.low_bit_states == 0
    assert facts.exporter == "model"  # peft=none builds ExportModel
    assert facts.optimizer.__name__ == "AdamW"


@pytest.mark.parametrize(("option", "stage", "offload_optimizer", "offload_parameters"), [
    ("zero1", 1, False, False), ("zero2", 2, False, False), ("zero2_offload", 2, True, False),
    ("zero3", 3, False, False), ("zero3_offload", 3, True, True)])
def test_zero_options_read_their_layout(option, stage, offload_optimizer, offload_parameters, tmp_path) -> None:
    facts = config_facts(compose_config([f"strategy={option}"], tmp_path))
    layout = facts.strategy
    assert layout.built and layout.zero and layout.deepspeed and layout.name == "ZeroStrategy"
    assert (layout.stage, layout.offload_optimizer, layout.offload_parameters) == (stage, offload_optimizer,
                                                                                   offload_parameters)
    assert "DeepSpeedStrategy" in layout.classes


def test_ddp_and_processes(tmp_path) -> None:
    facts = config_facts(compose_config(["strategy=ddp", "trainer=ddp_cpu", "trainer.devices=2"], tmp_path))
    assert facts.strategy.ddp and not facts.strategy.deepspeed and not facts.strategy.zero
    assert facts.processes == 2
    auto = config_facts(compose_config(["trainer.devices=auto"], tmp_path))
    assert auto.processes is None


def test_the_lora_preset_and_its_levers(tmp_path) -> None:
    facts = config_facts(compose_config(["experiment=finetune_1b_lora", "model.pretrained=/nowhere"], tmp_path))
    assert facts.hf_model and facts.text_folder and facts.lora and facts.exporter == "adapters"
    assert facts.adapters.r == 16 and facts.chunked_loss is not None and facts.checkpointing
    assert facts.callback_keys("ReturnFreedMemory") == ["return_freed_memory"]


@pytest.mark.parametrize(("option", "bits"), [("adamw8bit", 8), ("adamw4bit", 4), ("adamw", 0), ("muon", 0)])
def test_low_bit_states_come_from_the_class(option, bits, tmp_path) -> None:
    if bits:
        pytest.importorskip("torchao")
    assert config_facts(compose_config([f"optimizer={option}"], tmp_path)).low_bit_states == bits


def test_classes_are_recognised_by_what_they_are_not_how_their_target_is_spelt() -> None:
    cfg = OmegaConf.create({
        "callbacks": {"mine": {"_target_": f"{__name__}.RenamedCheckpointing"},
                      "keep": {"_target_": "lit_speed.KeepFreedMemory"}},  # the public name: same class
        "peft": {"_target_": f"{__name__}.RenamedAdapters", "method": "freeze"},
        "strategy": {"_target_": "lightning.pytorch.strategies.DeepSpeedStrategy"},  # DeepSpeed, not lit_speed's ZeRO
    })
    facts = config_facts(cfg)
    assert facts.checkpointing and facts.callback_keys("KeepFreedMemory") == ["keep"]
    assert facts.adapters is not None and not facts.lora  # method=freeze: no adapter trains
    assert facts.strategy.deepspeed and facts.strategy.ddp and not facts.strategy.zero
    named_alike = type("HFCausalLM", (), {})  # a class that only shares the name is not lit_speed's
    assert not is_a(named_alike, "HFCausalLM")


def test_a_target_that_does_not_import_is_unknown() -> None:
    cfg = OmegaConf.create({"strategy": {"_target_": "no_such_package.Strategy"},
                            "callbacks": {"x": {"_target_": "no_such_package.Callback"}},
                            "precision": {"_target_": "x.Y", "mode": "???"}})
    facts = config_facts(cfg)
    assert facts.strategy.built and facts.strategy.classes == () and facts.callbacks == {"x": None}
    assert facts.precision_mode is None

