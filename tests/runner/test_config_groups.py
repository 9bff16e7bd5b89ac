"""Every option of every config group composes and instantiates (new option files are picked up automatically)."""
from __future__ import annotations

import warnings

import pytest
import torch
from omegaconf import OmegaConf

from lit_speed.run.run_checks import RENAMED_CALLBACKS, check_config, warn_renamed_options
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


# -- variants compose from a base ------------------------------------------------------------------------------------
# each group's base option; every option of the group that builds the base's _target_ (plus EXTRA_MEMBERS) must be
# `defaults: [<base>, ..., _self_]` + its own keys, so a whole-copy variant or a drifted one fails here
BASES = {"precision": "32-true", "strategy": "zero", "optimizer": "adamw_base", "trainer": "default"}
EXTRA_MEMBERS = {"optimizer": ["cpu_adam"]}  # a different _target_ (DeepSpeed's CPU Adam) on AdamW's hyperparameters


def _file(group: str, option: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(CONF / group / f"{option}.yaml"))


def _members(group: str) -> list[str]:
    target = _file(group, BASES[group])["_target_"]
    same = [p.stem for p in sorted((CONF / group).glob("*.yaml")) if _file(group, p.stem).get("_target_") == target
            or any(d == BASES[group] for d in _file(group, p.stem).get("defaults", []))]
    return sorted(set(same + EXTRA_MEMBERS.get(group, [])) - {BASES[group]})


VARIANTS = [(g, o) for g in BASES for o in _members(g)]


def test_every_base_is_a_plain_option():
    for group, base in BASES.items():
        assert "defaults" not in _file(group, base), f"{group}/{base}.yaml is a base: it should compose from nothing"
        assert _members(group), f"no option of {group}/ composes from {base}"


@pytest.mark.parametrize(("group", "option"), VARIANTS, ids=[f"{g}={o}" for g, o in VARIANTS])
def test_variant_lists_its_base_first_and_self_last(group, option):
    defaults = _file(group, option).get("defaults")
    assert defaults, f"{group}/{option}.yaml should compose from {BASES[group]} (defaults: [{BASES[group]}, _self_])"
    assert defaults[0] == BASES[group] and defaults[-1] == "_self_", (
        f"{group}/{option}.yaml: defaults should start with {BASES[group]!r} and end with '_self_' (its own keys win), "
        f"got {defaults}")


@pytest.mark.parametrize(("group", "option"), VARIANTS, ids=[f"{g}={o}" for g, o in VARIANTS])
def test_variant_is_its_base_updated_with_its_own_keys(make_cfg, group, option):
    base = OmegaConf.to_container(make_cfg([f"{group}={BASES[group]}"])[group])  # unresolved: ${...} kept as text
    own = {k: v for k, v in _file(group, option).items() if k != "defaults"}
    assert own, f"{group}/{option}.yaml sets nothing of its own: use {group}={BASES[group]}"
    assert not set(base) <= set(own), f"{group}/{option}.yaml repeats every key of {BASES[group]}: keep those that differ"
    composed = make_cfg([f"{group}={option}"])[group]
    assert OmegaConf.to_container(composed) == OmegaConf.to_container(OmegaConf.merge(base, own))


# -- renamed options keep working one release ------------------------------------------------------------------------
RENAMED = sorted(RENAMED_CALLBACKS.items())


@pytest.mark.parametrize(("old", "new"), RENAMED, ids=[f"{o}->{n}" for o, n in RENAMED])
def test_old_callbacks_name_composes_the_new_option_under_its_old_key(make_cfg, old, new):
    assert _file("callbacks", old)["defaults"] == [f"{new}@{old}"], f"callbacks/{old}.yaml should only compose {new}"
    old_cfg = make_cfg([f"callbacks=[default,{old}]"]).callbacks
    new_cfg = make_cfg([f"callbacks=[default,{new}]"]).callbacks
    assert old in old_cfg and new not in old_cfg and new in new_cfg and old not in new_cfg
    assert OmegaConf.to_container(old_cfg[old]) == OmegaConf.to_container(new_cfg[new])
    first_key = next(k for k in new_cfg[new] if k != "_target_")
    patched = make_cfg([f"callbacks=[{old}]", f"callbacks.{old}.{first_key}=null"]).callbacks
    assert patched[old][first_key] is None  # overrides written for the old key still apply


@pytest.mark.parametrize(("old", "new"), RENAMED, ids=[f"{o}->{n}" for o, n in RENAMED])
def test_old_callbacks_name_warns_naming_the_new_one(make_cfg, old, new):
    with pytest.warns(DeprecationWarning, match=rf"callbacks option '{old}' is deprecated .* renamed '{new}'"):
        check_config(make_cfg([f"callbacks=[default,{old}]"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        warn_renamed_options(make_cfg([f"callbacks=[default,{new}]"]))  # the new name is quiet
