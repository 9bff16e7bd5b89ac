"""Docs beside the code (issue 25): a short top README, one card per component, every measured number's machine named,
and presets whose comments say what each key does (the tuning history lives in benchmarks/RESULTS.md)."""
from __future__ import annotations

import re

import pytest

from tests.helpers.repo import CARDS, CONF, ROOT

README = (ROOT / "README.md").read_text()
COMPONENTS = sorted(p.name for p in (ROOT / "lit_speed").iterdir()
                    if (p / "__init__.py").is_file() and p.name != "compat")  # compat's card is its docstring
SECTIONS = ("## Use it", "## From Hydra", "## Guarantees", "## Measured effect")


def _machines() -> set[str]:
    table = README.split("## Machines", 1)[1].split("\n## ", 1)[0]
    return {row.split("|")[1].strip() for row in table.splitlines() if re.match(r"^\| [A-Z]\w* \|", row)}


def test_the_readme_is_short_and_opens_with_the_two_commands() -> None:
    lines = README.splitlines()
    assert len(lines) <= 250
    first_screen = "\n".join(lines[:30])
    for command in ("bash scripts/run.sh train", "bash scripts/run.sh test"):
        assert re.search(rf"^{re.escape(command)}\s", first_screen, re.M), command


def test_every_component_has_a_card_and_the_readme_indexes_it() -> None:
    assert {c.parent.name for c in CARDS} >= set(COMPONENTS)
    linked = set(re.findall(r"\]\((lit_speed/\w+/README\.md)\)", README))
    assert linked == {f"lit_speed/{c}/README.md" for c in COMPONENTS}
    assert all((ROOT / link).is_file() for link in linked)


@pytest.mark.parametrize("card", CARDS, ids=lambda p: p.parent.name)
def test_a_card_says_how_to_use_it_alone_and_from_hydra_what_it_guarantees_and_what_it_measured(card) -> None:
    text = card.read_text()
    assert text.startswith("# ")
    for section in SECTIONS:
        assert re.search(rf"^{re.escape(section)}", text, re.M), f"{card.relative_to(ROOT)} has no {section!r}"


@pytest.mark.parametrize("card", CARDS, ids=lambda p: p.parent.name)
def test_every_measured_row_names_its_machine(card) -> None:
    machines = _machines() | {"any"}
    measured = card.read_text().split("## Measured effect", 1)[1]
    rows = [r for r in measured.splitlines() if r.startswith("| ") and not r.startswith(("| machine", "|---"))]
    for row in rows:
        first = row.split("|")[1].strip()
        assert first.split(",")[0].split(" ")[0] in machines, f"{card.relative_to(ROOT)}: {row[:80]!r} names no machine"


def test_the_machine_table_names_every_cpu_the_numbers_came_from() -> None:
    assert {"Z3", "XA", "Z4", "Z5"} <= _machines()


@pytest.mark.parametrize("preset", sorted((CONF / "experiment").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_preset_key_says_what_it_does(preset) -> None:
    lines = preset.read_text().replace(",\n", ", ").splitlines()  # a flow list over two lines is one value
    body = [line for line in lines if line and not line.lstrip().startswith(("#", "-", "defaults:"))]
    leaves = [line for line in body if re.match(r"^\s+[\w.]+:\s*\S", line) and "_target_" not in line]
    assert leaves and all("#" in line for line in leaves), [line for line in leaves if "#" not in line]
    header = [line for line in lines if line.startswith("#")]
    assert len(header) <= 12, f"{preset.name}: a long header is a tuning diary: move it to benchmarks/RESULTS.md"


def test_the_linter_ci_runs_passes() -> None:
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (the test extra installs it: bash scripts/run.sh test)")
    assert "python3 -m ruff check ." in (ROOT / ".ci" / "run").read_text()
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-3000:]


def _levers_snippet() -> str:
    section = README.split("### The fast preset's levers in your own module", 1)[1]
    return section.split("```python", 1)[1].split("```", 1)[0]


def test_the_readme_levers_run_and_carry_the_presets_values() -> None:
    """The README's copy-the-levers snippet runs on a module of the user's own and matches experiment=charlm_fast."""
    import torch
    from hydra import compose, initialize_config_dir
    from torch import nn

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=charlm_fast"])
    namespace: dict = {"Trainer": lambda **kwargs: kwargs}
    exec(compile(_levers_snippet(), "README.md", "exec"), namespace)  # noqa: S102 - our own README's code

    class Users(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding, self.hidden = nn.Embedding(10, 8), nn.Linear(8, 8)

    out = namespace["configure_optimizers"](Users())
    muon, adamw = out["optimizer"].muon.param_groups[0], out["optimizer"].adamw.param_groups[0]
    assert (muon["initial_lr"], muon["momentum"], adamw["initial_lr"]) == (cfg.optimizer.lr, cfg.optimizer.momentum,
                                                           cfg.optimizer.adamw_lr)
    from lit_speed.optim.schedules import warmup_stable_decay

    preset = warmup_stable_decay(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0),
                                 total_steps=cfg.trainer.max_steps,
                                 **{k: v for k, v in cfg.model.scheduler.items() if not k.startswith("_")})
    readme = out["lr_scheduler"]["scheduler"]
    for step in (0, 10, 100, 200, 300, 374, 1000):  # the README's schedule is the preset's, step by step
        assert readme.lr_lambdas[0](step) == preset.lr_lambdas[0](step), step
    trainer = namespace["trainer"]
    assert trainer["plugins"][0].requested_mode == cfg.precision.mode
    assert trainer["callbacks"][0].effective_batch == {int(k): int(v) for k, v in cfg.accumulation.effective_batch}


# -- lists of options that cannot go stale (issue 34) -----------------------------------------------------------------
def _options(group: str) -> set[str]:
    return {p.stem for p in (CONF / group).glob("*.yaml")}


def test_the_options_listed_in_train_yaml_are_the_option_files() -> None:
    """``conf/train.yaml``'s defaults comments that list a group's options (``a | b | c``) name exactly its files."""
    checked = 0
    for line in (CONF / "train.yaml").read_text().splitlines():
        m = re.match(r"^\s+- (\w+): \S+\s+# (.*)$", line)
        if not m or " | " not in m.group(2):
            continue
        group, listed = m.group(1), {re.match(r"[\w-]+", part.strip()).group(0) for part in m.group(2).split(" | ")}
        assert listed == _options(group), (f"conf/train.yaml lists {sorted(listed)} for {group}; conf/{group}/ holds "
                                           f"{sorted(_options(group))}")
        checked += 1
    assert checked >= 8, f"only {checked} groups list their options in conf/train.yaml"


def test_the_readmes_group_table_names_every_option() -> None:
    """Each row of the README's group table (``| `a`, `b` | options of a; options of b |``) names exactly the
    options in ``conf/<group>/`` (backticked names; ``key=value`` examples are not options)."""
    rows = [r for r in README.split("| group | options |", 1)[1].split("\n\n", 1)[0].splitlines() if r.startswith("| `")]
    seen = set()
    for row in rows:
        _, groups_cell, options_cell, _ = row.split("|")
        groups = re.findall(r"`([\w]+)`", groups_cell)
        cells = options_cell.split(";") if len(groups) > 1 else [options_cell]
        assert len(cells) == len(groups), f"README row {groups}: one ';'-separated list per group"
        for group, cell in zip(groups, cells):
            named = {t for t in re.findall(r"`([^`]+)`", cell) if "=" not in t}
            assert named == _options(group), f"README's {group} row names {sorted(named)}; conf/{group}/ holds " \
                                             f"{sorted(_options(group))}"
            seen.add(group)
    from tests.run.test_config_groups import GROUPS

    assert seen == set(GROUPS), f"groups missing from the README's table: {sorted(set(GROUPS) - seen)}"
