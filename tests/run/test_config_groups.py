"""Every option of every config group composes and instantiates (new option files are picked up automatically)."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from lit_speed.run.runner import build
from tests.helpers.repo import CONF

# groups whose options are whole components; hydra/ and paths/ are Hydra plumbing, tested through every compose
GROUPS = ["data", "model", "optimizer", "precision", "strategy", "accumulation", "callbacks", "logger", "trainer",
          "experiment", "debug", "hparams_search", "init", "peft"]
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]


def _skip_reason(group: str, option: str) -> str | None:
    if group == "trainer" and option == "gpu" and not torch.cuda.is_available():
        return "trainer=gpu needs a CUDA device; none on this machine"
    return None


def _required_values(group: str, option: str, make_cfg, tmp_path) -> list[str]:
    """What an option leaves to the command line (``???``), made here: a tiny HF folder, a weights file."""
    if (group, option) in (("data", "text_folder"), ("model", "hf_causal_lm")):
        from tests.helpers.tiny_hf import STDLIB, save_tiny_causal_lm

        folder = save_tiny_causal_lm(tmp_path / "hf")
        return ["data=text_folder", "model=hf_causal_lm", f"model.pretrained={folder}", f"data.root={STDLIB / 'json'}"]
    if (group, option) == ("experiment", "finetune_1b_lora"):
        # the preset names a 1B folder that benchmarks/model_folders.py builds (minutes, 5 GB); a tiny folder of the
        # same family stands in so that a clean checkout composes and instantiates everything else the preset sets
        from tests.helpers.tiny_hf import save_tiny_causal_lm

        return [f"model.pretrained={save_tiny_causal_lm(tmp_path / 'hf', max_positions=512)}"]
    if (group, option) in (("data", "sft"), ("experiment", "sft_lora")):
        # a tiny chat model stands in for the preset's 0.5B folder; a tiny JSONL for the user's examples
        from tests.helpers.sft import write_examples
        from tests.helpers.tiny_hf import save_tiny_causal_lm

        folder = save_tiny_causal_lm(tmp_path / "hf", chat=True, max_positions=512)
        return (["model=hf_causal_lm"] if group == "data" else []) + [
            f"model.pretrained={folder}", f"data.source={write_examples(tmp_path, 'chat', n=8)}",
            f"data.cache_dir={tmp_path / 'sft_cache'}", "data.max_length=256"]
    if (group, option) in (("init", "weights"), ("experiment", "charlm_finetune")):
        base = ["experiment=charlm_cpu"] if option == "charlm_finetune" else []
        weights = tmp_path / "weights.pt"  # instead of the preset's pretraining run (scripts/train.py, ~1 min)
        torch.save(build(make_cfg(base))["model"].state_dict(), weights)
        return [f"init.path={weights}"]
    return []


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_option_composes_and_instantiates(make_cfg, tmp_path, group, option):
    reason = _skip_reason(group, option)
    if reason:
        pytest.skip(reason)
    overrides = [f"{group}={option}"]
    if group == "model" and option == "gpt":
        overrides.append("data=charlm")  # gpt takes block_size from the data
    overrides += _required_values(group, option, make_cfg, tmp_path)
    cfg = make_cfg(overrides)
    parts = build(cfg)
    trainer = parts["trainer"]
    assert trainer is not None and parts["model"] is not None and parts["datamodule"] is not None
    node = cfg.get(group)
    if group in ("data", "model") and node is not None and "_target_" in node:
        expected = node._target_.rsplit(".", 1)[-1]
        actual = parts["datamodule" if group == "data" else "model"]
        assert type(actual).__name__ == expected
    if group == "callbacks":
        names = {type(cb).__name__ for cb in parts["callbacks"]}
        for value in (cfg.callbacks or {}).values():
            assert value._target_.rsplit(".", 1)[-1] in names


def test_every_group_has_options():
    for group in GROUPS:
        assert list((CONF / group).glob("*.yaml")), f"conf/{group}/ has no options"


def test_defaults_list_is_the_architecture(make_cfg):
    cfg = make_cfg([])
    for key in ("data", "model", "optimizer", "precision", "strategy", "accumulation", "callbacks", "logger",
                "trainer", "paths"):
        assert key in cfg, f"train.yaml does not compose the {key!r} group"


@pytest.mark.parametrize("path", sorted(CONF.rglob("*.yaml")), ids=lambda p: str(p.relative_to(CONF)))
def test_every_option_file_has_a_header_comment(path):
    first = path.read_text().lstrip().splitlines()[0]
    assert first.startswith("#"), f"{path.relative_to(CONF)} should start with a comment showing how it is used"


# -- options compose from a base -------------------------------------------------------------------------------------
# The naming rule: a base is conf/base/<what its options share>.yaml (the snake_case of the class it builds, as module
# names are: guarded_precision, zero_strategy, accumulation_scheduler, trainer, adamw; loader_options for the loader
# block). A base is not an option: it composes from nothing and leaves what tells its options apart required (???).
# Every option that shares its settings is `defaults: [/base/<name>@_here_, ..., _self_]` + its own keys, so a
# whole-copy variant or a drifted one fails here.
BASE_DIR = CONF / "base"
BASES = sorted(p.stem for p in BASE_DIR.glob("*.yaml"))


def _file(group: str, option: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(CONF / group / f"{option}.yaml"))


def _base_of(group: str, option: str) -> str | None:
    entries = [d for d in _file(group, option).get("defaults", []) if isinstance(d, str) and d.startswith("/base/")]
    return entries[0].removeprefix("/base/").split("@")[0] if entries else None


MEMBERS = [(g, p.stem, _base_of(g, p.stem)) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))
           if _base_of(g, p.stem)]
# each base, and the options that must compose from it: the group's options that build its class (or, for a base
# without a class, every option of the group it serves)
FAMILIES = {"guarded_precision": ("precision", None), "zero_strategy": ("strategy", "ZeroStrategy"),
            "accumulation_scheduler": ("accumulation", None), "trainer": ("trainer", None),
            "adamw": ("optimizer", "AdamW"), "loader_options": ("data", None)}


def test_every_base_is_no_option_composes_from_nothing_and_is_used() -> None:
    assert sorted(FAMILIES) == BASES, "a base in conf/base/ without a family here, or the reverse"
    for base in BASES:
        text = OmegaConf.load(BASE_DIR / f"{base}.yaml")
        assert "defaults" not in text, f"base/{base}.yaml should compose from nothing"
        assert len([m for m in MEMBERS if m[2] == base]) >= 2, f"base/{base}.yaml serves fewer than two options"
    assert not any((CONF / g / f"{b}.yaml").exists() for g in GROUPS for b in ("zero", "adamw_base")), \
        "an old base is still an option"


@pytest.mark.parametrize("base", BASES)
def test_every_option_of_a_family_composes_from_its_base(base: str) -> None:
    group, cls = FAMILIES[base]
    for path in sorted((CONF / group).glob("*.yaml")):
        target = str(_file(group, path.stem).get("_target_", ""))
        family = cls is None or target.rsplit(".", 1)[-1] == cls or _base_of(group, path.stem) == base
        if family and path.stem != "none":
            assert _base_of(group, path.stem) == base, f"{group}/{path.stem}.yaml should compose from base/{base}"


@pytest.mark.parametrize(("group", "option", "base"), MEMBERS, ids=[f"{g}={o}" for g, o, _ in MEMBERS])
def test_option_lists_its_base_first_and_self_last(group: str, option: str, base: str) -> None:
    defaults = _file(group, option)["defaults"]
    assert defaults[0] == f"/base/{base}@_here_" and defaults[-1] == "_self_", (
        f"{group}/{option}.yaml: defaults should start with '/base/{base}@_here_' and end with '_self_' (its own keys "
        f"win), got {defaults}")


@pytest.mark.parametrize(("group", "option", "base"), MEMBERS, ids=[f"{g}={o}" for g, o, _ in MEMBERS])
def test_option_is_its_base_updated_with_its_own_keys(make_cfg, group: str, option: str, base: str) -> None:
    base_keys = OmegaConf.to_container(OmegaConf.load(BASE_DIR / f"{base}.yaml"))
    own = {k: v for k, v in _file(group, option).items() if k != "defaults"}
    assert own or option == "default", f"{group}/{option}.yaml sets nothing of its own"
    assert not set(base_keys) <= set(own), f"{group}/{option}.yaml repeats every key of base/{base}: keep those that differ"
    required = [k for k, v in base_keys.items() if v == "???"]
    assert all(k in own for k in required), f"{group}/{option}.yaml leaves base/{base}'s {required} unset"
    composed = OmegaConf.to_container(make_cfg([f"{group}={option}"])[group])
    for key, value in OmegaConf.to_container(OmegaConf.merge(base_keys, own)).items():
        if isinstance(value, dict):  # a wrapped datamodule's node: its own defaults, updated with these keys
            value = {k: v for k, v in composed[key].items() if k not in value} | value
        assert composed[key] == value, f"{group}={option}: {key}={composed[key]!r}, expected {value!r}"


def test_every_target_of_ours_is_spelt_with_its_module_path() -> None:
    """``_target_: lit_speed.<package>.<module>.<Class>``, one spelling for all (issue 34), and each one imports."""
    import importlib
    import re

    targets = {m.group(1) for p in CONF.rglob("*.yaml")
               for m in re.finditer(r"_target_:\s*(lit_speed\.[\w.]+)", p.read_text())}
    assert targets
    short = sorted(t for t in targets if t.count(".") < 3)
    assert not short, f"targets through the package face (spell the module: lit_speed.<package>.<module>.<name>): {short}"
    for target in targets:
        module, name = target.rsplit(".", 1)
        assert hasattr(importlib.import_module(module), name), target
