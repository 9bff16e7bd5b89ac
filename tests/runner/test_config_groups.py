"""Every option of every config group composes and instantiates (new option files are picked up automatically)."""
from __future__ import annotations

import pytest
import torch

from lit_speed.runner import build
from tests.helpers.repo import CONF

# groups whose options are whole components; hydra/ and paths/ are Hydra plumbing, tested through every compose
GROUPS = ["data", "model", "optimizer", "precision", "strategy", "accumulation", "callbacks", "logger", "trainer",
          "experiment", "debug", "hparams_search"]
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]


def _skip_reason(group: str, option: str) -> str | None:
    if group == "trainer" and option == "gpu" and not torch.cuda.is_available():
        return "trainer=gpu needs a CUDA device; none on this machine"
    return None


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_option_composes_and_instantiates(make_cfg, group, option):
    reason = _skip_reason(group, option)
    if reason:
        pytest.skip(reason)
    overrides = [f"{group}={option}"]
    if group == "model" and option == "gpt":
        overrides.append("data=charlm")  # gpt takes block_size from the data
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
