"""data=sft's bad inputs: each one line naming the file, the line and the setting, before anything is trained.

In process (what ``scripts/train.py`` runs, a ``ConfigError``) for every case, and through the real entry point (exit 2,
one ``Config error:`` line, no checkpoint) for each case in the slow tier and two in the default one.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from tempfile import mkdtemp

import pytest

from lit_speed.run.config_error import ConfigError
from lit_speed.run.runner import train
from lit_speed.sft import loading
from tests.helpers.fault_scripts.runs import explain
from tests.helpers.fault_scripts.runs import train as run_script
from tests.helpers.sft import write_jsonl

FILES = Path(mkdtemp(prefix="sft_bad_input_"))
GOOD = [{"messages": [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": f"answer {i}."}]}
        for i in range(6)]


def _records(name: str, change) -> str:
    rows = json.loads(json.dumps(GOOD))
    change(rows)
    return str(write_jsonl(FILES / f"{name}.jsonl", rows))


def _malformed() -> str:
    path = FILES / "malformed.jsonl"
    path.write_text(json.dumps(GOOD[0]) + "\n" + json.dumps(GOOD[1])[:-3] + "\n")
    return str(path)


def _bad_template() -> str:
    path = FILES / "broken.jinja"
    path.write_text("{% for m in messages %}{{ m.content }")
    return str(path)


# name: (overrides beyond a good run, the message, runs through scripts/train.py in the default tier?)
CASES = {
    "malformed_json_line": (lambda: [f"data.source={_malformed()}"],
                            r"^data\.source: .*malformed\.jsonl line 2 is not a JSON object \(.*\)\. Fix: correct or "
                            r"remove that line$", True),
    "missing_column": (lambda: [f"data.source={write_jsonl(FILES / 'qa.jsonl', [{'q': 'x', 'a': 'y'}] * 4)}"],
                       r"no known format in the columns \['q', 'a'\].*Fix: data\.columns=\{prompt: <your prompt "
                       r"column>, completion: <your response column>\}", False),
    "empty_response": (lambda: [f"data.source={_records('empty', lambda r: r[2]['messages'][1].update(content=''))}"],
                       r"^data\.source: .*empty\.jsonl line 3: turn 1 \(assistant\) is an empty response\. Fix: ", False),
    "no_assistant_turn": (lambda: [f"data.source={_records('noasst', lambda r: r[4]['messages'].pop())}"],
                          r"^data\.source: .*noasst\.jsonl line 5: the conversation has no assistant turn \(roles "
                          r"\['user'\]\): nothing to train on\. Fix: ", False),
    "unknown_role": (lambda: [f"data.source={_records('role', lambda r: r[1]['messages'][1].update(role='bot'))}"],
                     r"^data\.source: .*role\.jsonl line 2: messages\[1\] has the role 'bot', not one of \['system', "
                     r"'user', 'assistant'\]\. Fix: ", False),
    "template_fails_to_render": (lambda: [f"data.template={_bad_template()}"],
                                 r"^data\.source: .*good\.jsonl line 1: the chat template failed to render it "
                                 r"\(TemplateSyntaxError: .*\)\. Fix: data\.template=", False),
    "no_template": (lambda: ["+model_folder=plain"],
                    r"data\.template=auto: SFTDataModule\(template=auto\): the tokenizer .* has no chat template\. "
                    r"Fix: data\.template=<one of chatml, llama3, alpaca, none>", True),
    "dataset_id_offline": (lambda: ["data.source=nobody/no-such-dataset"],
                           r"data\.source=nobody/no-such-dataset: not a file or folder here; .*Fix: data\.source=<a "
                           r"local \.jsonl", False),
    "everything_too_long_with_drop": (lambda: ["data.max_length=4", "data.overlong=drop"],
                                      r"^data\.source: no training example is left of \d+: \d+ longer than "
                                      r"max_length=4 were dropped \(data\.overlong=drop\)\. Fix: "
                                      r"data\.overlong=truncate, or a larger data\.max_length$", False),
}


@pytest.fixture(scope="module")
def models():
    from tests.helpers.tiny_hf import save_tiny_causal_lm

    return {"chat": save_tiny_causal_lm(FILES / "chat", chat=True, max_positions=512),
            "plain": save_tiny_causal_lm(FILES / "plain", max_positions=512)}


def args_for(case: str, models) -> list[str]:
    extra = CASES[case][0]()
    model = models["plain" if "+model_folder=plain" in extra else "chat"]
    good = write_jsonl(FILES / "good.jsonl", GOOD)
    return ["model=hf_causal_lm", "data=sft", "peft=lora", f"model.pretrained={model}", f"data.source={good}",
            f"data.cache_dir={FILES / 'cache' / case}", "data.val_size=1", "data.max_length=256", "trainer.max_steps=2",
            "logger=none",
            "callbacks=[model_checkpoint]", *[e for e in extra if not e.startswith("+model_folder")]]


@pytest.mark.parametrize("case", list(CASES))
def test_each_bad_input_is_one_line_naming_the_setting_before_training(case, models, make_cfg, tmp_path, monkeypatch):
    monkeypatch.setattr(loading, "hub_reachable", lambda timeout=3.0: False)  # offline here even where it is online
    with pytest.raises(ConfigError) as error:
        train(make_cfg(args_for(case, models)))
    assert re.search(CASES[case][1], str(error.value)), str(error.value)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "summary.json").exists()
    if case != "everything_too_long_with_drop":  # that data tokenized fine: its cache serves the next max_length
        assert not list((FILES / "cache" / case).glob("sft-tokens-*.arrow")), "a refused data set left its tokens"


@pytest.mark.parametrize("case", [pytest.param(c, marks=[] if fast else [pytest.mark.slow], id=c)
                                  for c, (_, _, fast) in CASES.items() if c != "dataset_id_offline"])
def test_train_py_exits_2_with_the_one_line(case, models, tmp_path):
    proc = run_script(args_for(case, models), tmp_path / "run", timeout=300)
    assert proc.returncode == 2, explain(proc)
    lines = re.findall(r"^Config error: .*$", proc.stderr, flags=re.M)
    assert len(lines) == 1 and re.search(CASES[case][1], lines[0].removeprefix("Config error: ")), explain(proc)
    assert "Traceback" not in proc.stderr and not (tmp_path / "run" / "checkpoints").exists()
