"""Every ``data.*``, ``precision.*`` and ``accumulation.*`` key the README names is accepted by ``scripts/train.py``.

The README promises keys in three ways: dotted (``precision.init_scale=1024``), as loader options of the data
options (``Loader options on `data=digits|charlm`: `num_workers: auto`, ...``), and as the component's argument
names in backticks (``Scaler settings `init_scale, growth_factor, ...```, ``lr_scaling``). One pre-flight per
option sets all of them that its class takes, to the values the option has (Hydra refuses a key the option lacks;
the pre-flight also checks the class takes it). Config mirrors code: every constructor argument of the component is
a key of its option files.
"""
from __future__ import annotations

import inspect
import json
import re

import pytest
from omegaconf import OmegaConf

from lit_speed import AccumulationScheduler, GuardedPrecision
from lit_speed.data.charlm import CharLMDataModule
from lit_speed.data.digits import DigitsDataModule
from lit_speed.data.text_folder import TextFolderDataModule
from lit_speed.run.config_check import preflight
from lit_speed.sft.sft_data_module import SFTDataModule
from tests.helpers.repo import CONF, ROOT, docs_text

README = docs_text()  # the top README and the component cards

# group -> (the options a README key of the group applies to, as overrides; the component class they build)
GROUPS = {
    "data": {"digits": (["data=digits"], DigitsDataModule), "charlm": (["experiment=charlm_cpu"], CharLMDataModule),
             "text_folder": (["data=text_folder", "model=hf_causal_lm", "model.pretrained=/path/to/hf_folder",
                              "data.root=/path/to/texts"], TextFolderDataModule),
             "sft": (["data=sft", "model=hf_causal_lm", "model.pretrained=/path/to/hf_folder",
                      "data.source=/path/to/examples.jsonl"], SFTDataModule)},
    "precision": {p.stem: ([f"precision={p.stem}"], GuardedPrecision) for p in sorted((CONF / "precision").glob("*.yaml"))},
    "accumulation": {o: ([f"accumulation={o}"], AccumulationScheduler) for o in ("fixed", "ramp")},
}


def _arguments(cls: type) -> set[str]:
    return {n for n in inspect.signature(cls).parameters if n not in ("self", "args", "kwargs")}


def readme_keys() -> dict[str, set[str]]:
    """``{group: key names}`` the README names for each group (``lit_speed.data.pipeline``-style module names and
    code blocks left out)."""
    keys: dict[str, set[str]] = {group: set() for group in GROUPS}
    prose = re.sub(r"```.*?```", "", README, flags=re.S)
    commands = "\n".join(line for line in README.splitlines() if "scripts/train.py" in line)
    for group, key in re.findall(r"(?<![\w.])(data|precision|accumulation)\.(\w+)", prose + commands):
        if not (ROOT / "lit_speed" / group / f"{key}.py").exists():  # a module, not a key
            keys[group].add(key)
    loader = re.search(r"Loader options on `data=([\w|]+)`:(.*?)\(after transfer", prose, re.S)
    keys["data"] |= set(re.findall(r"`(\w+)(?::[^`]*)?`", loader.group(2)))
    quoted = {w for span in re.findall(r"`([^`]+)`", prose) for w in re.findall(r"\b(\w+)\b", span)}
    for group, options in GROUPS.items():
        arguments = set.union(*(_arguments(cls) for _, cls in options.values()))
        keys[group] |= quoted & arguments  # the component's argument names the README quotes
    return keys


KEYS = readme_keys()


def _value(value) -> str:
    """An override value Hydra parses back to ``value``."""
    return "null" if value is None else json.dumps(OmegaConf.to_container(value) if OmegaConf.is_config(value) else value)


def test_the_readme_names_the_keys_this_test_expects_to_find():
    # guards the extraction: the keys the issue found missing, and a few of each group
    assert {"pin_memory", "persistent_workers", "prefetch_factor", "preload", "batch_transform", "num_workers",
            "batch_size", "block_size"} <= KEYS["data"]
    assert {"init_scale", "fp32_modules", "growth_interval", "min_scale", "matmul_precision"} <= KEYS["precision"]
    assert {"factors", "micro_batch", "normalize", "lr_scaling", "memory_budget_mb"} <= KEYS["accumulation"]


def test_every_readme_key_is_taken_by_some_option_of_its_group():
    for group, keys in KEYS.items():
        arguments = set.union(*(_arguments(cls) for _, cls in GROUPS[group].values()))
        assert keys <= arguments, f"the README names {group}.{sorted(keys - arguments)}, which no {group} option takes"


@pytest.mark.parametrize(("group", "option"), [(g, o) for g in GROUPS for o in GROUPS[g]])
def test_readme_keys_of_an_option_compose_and_pass_the_preflight(make_cfg, group, option):
    """Each README key the option's class takes is a key of the option, and all of them set on the command line
    (to the values the option has) pass ``scripts/train.py``'s pre-flight, which also checks the class takes them."""
    overrides, cls = GROUPS[group][option]
    node = make_cfg(overrides)[group]
    keys = sorted(k for k in KEYS[group] if k in _arguments(cls))
    missing = [k for k in keys if k not in node]
    assert not missing, f"the README names {', '.join(f'{group}.{k}' for k in missing)}; {group}={option} has no such key"
    preflight([*overrides, *(f"{group}.{k}={_value(node[k])}" for k in keys)])


@pytest.mark.parametrize(("group", "option"), [(g, o) for g in GROUPS for o in GROUPS[g]])
def test_every_constructor_argument_is_a_key_of_the_option(make_cfg, group, option):
    overrides, cls = GROUPS[group][option]
    node = make_cfg(overrides)[group]
    missing = _arguments(cls) - set(node) - {"cache_dir"} if group == "data" else _arguments(cls) - set(node)
    assert not missing, f"{group}={option}: {cls.__name__} arguments without a key in conf/{group}/: {sorted(missing)}"
