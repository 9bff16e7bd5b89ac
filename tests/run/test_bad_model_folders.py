"""A user's own Hugging Face folders in the bad-input matrix: each one is refused before the model's weights load,
in one line naming the setting and a fix that works (issue 33, items 1-3).

Tiny folders are built offline in a temporary directory (``tests/helpers/tiny_hf.py``): Qwen2 with tied embeddings
(rotary positions), OPT (learned positions), a folder without tokenizer files, and a locally trained tokenizer whose
vocabulary (2000) is larger than the model's embedding (1024). Each case runs in process (``train``: the message,
and no weights loaded) and through ``scripts/train.py`` (exit 2, one ``Config error:`` line, no traceback).
"""
from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
from functools import lru_cache
from pathlib import Path
from subprocess import CompletedProcess

import pytest

from lit_speed.run.config_error import ConfigError
from lit_speed.run.runner import train
from tests.helpers.fault_scripts.runs import explain
from tests.helpers.fault_scripts.runs import train as train_script
from tests.helpers.repo import ROOT, plan_script

pytest.importorskip("transformers")

TEXTS = Path(sysconfig.get_paths()["stdlib"]) / "json"
TWO_STEPS = ["trainer.max_steps=2", "trainer.limit_val_batches=1", "trainer.num_sanity_val_steps=0", "logger=none",
             "callbacks=none", "validate=false", "trainer.enable_progress_bar=false",
             "trainer.enable_model_summary=false"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    from tests.helpers.tiny_hf import save_tiny_causal_lm

    root = tmp_path_factory.mktemp("hf_folders")
    half = save_tiny_causal_lm(root / "half_written", "qwen2", max_positions=64)
    weights = half / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a download cut off half-way
    return {"half_written": half, "qwen2": save_tiny_causal_lm(root / "qwen2", "qwen2", max_positions=64),
            "opt": save_tiny_causal_lm(root / "opt", "opt", max_positions=64),
            "no_tokenizer": save_tiny_causal_lm(root / "no_tokenizer", "qwen2", tokenizer=False),
            "big_vocab": save_tiny_causal_lm(root / "big_vocab", "llama", vocab_size=2000, model_vocab_size=1024)}


def _run(folder: Path, *overrides: str) -> list[str]:
    return ["model=hf_causal_lm", "data=text_folder", f"model.pretrained={folder}", f"data.root={TEXTS}", *overrides]


# case: (folder, overrides, what the one line must say)
CASES = {
    # 1. transformers 5 builds an empty tokenizer from a folder without tokenizer files
    "folder_without_tokenizer": ("no_tokenizer", [],
                                 r"^data\.tokenizer=.*no_tokenizer: TextFolderDataModule\(tokenizer=.*\): no usable "
                                 r"tokenizer there: transformers built Qwen2Tokenizer with 1 token\(s\).* the folder has "
                                 r"no tokenizer file .*Fix: data\.tokenizer=<a folder with the model's tokenizer files, "
                                 r"or its hub id> \(data\.tokenizer defaults to model\.pretrained\)$"),
    # 2. a tokenizer of 2000 ids into an embedding of 1024 rows (was a 95-line IndexError in the sanity check)
    "tokenizer_larger_than_the_embedding": ("big_vocab", [],
                                            r"^data\.tokenizer=.*big_vocab: its vocabulary has 2,000 token ids, the "
                                            r"embedding of LlamaForCausalLM has 1,024 rows \(model\.pretrained=.*\): ids "
                                            r"1,024 to 1,999 would index outside it.*Fix: the tokenizer the model was "
                                            r"trained with \(data\.tokenizer="),
    # 3. a window past the positions: learned (OPT: IndexError before) and rotary (Qwen2: trained on silently)
    "block_past_learned_positions": ("opt", ["data.block_size=128"],
                                     r"^data\.block_size=128: longer than the 64 positions of OPTForCausalLM "
                                     r"\(model\.pretrained=.*\): its position embeddings are a learned table of 64 rows"
                                     r".*Fix: data\.block_size=64 \(or less\)$"),
    "block_past_rotary_positions": ("qwen2", ["data.block_size=128"],
                                    r"^data\.block_size=128: longer than the 64 positions Qwen2ForCausalLM was made for "
                                    r"\(max_position_embeddings, model\.pretrained=.*\): its rotary positions run past "
                                    r"it, at positions the model never saw in training.*Fix: data\.block_size=64 \(or "
                                    r"less\); to train past it on purpose, raise max_position_embeddings in "
                                    r".*config\.json$"),
    # 4. the dtype a folder is read in (peft.base_dtype=bf16 sets it): refused before from_pretrained runs
    "load_dtype_not_a_dtype": ("qwen2", ["model.load_dtype=fp16", "data.block_size=32"],
                               r"HFCausalLM\(pretrained=.*\): load_dtype='fp16' is not one of float32, bf16, int8\. Fix: "
                               r"model\.load_dtype=null \(float32\), or peft\.base_dtype=bf16"),
    # issue 50: lines that blamed another setting (model.pretrained, data.root), named none, or said nothing
    "base_dtype_int4": ("qwen2", ["peft=lora", "peft.base_dtype=int4", "data.block_size=32"],
                        r"^peft\.base_dtype='int4': PEFTAdapters\(base_dtype='int4'\): the frozen base is held in one of "
                        r"bf16, int8 or as loaded \(null\), or auto decides\. Fix: base_dtype=bf16, or base_dtype=auto$"),
    "base_dtype_fp8": ("qwen2", ["peft=lora", "peft.base_dtype=fp8", "data.block_size=32"],
                       r"^peft\.base_dtype='fp8': PEFTAdapters\(base_dtype='fp8'\): .*Fix: base_dtype=bf16"),
    "alpha_negative": ("qwen2", ["peft=lora", "peft.alpha=-1", "data.block_size=32"],
                       r"^peft\.alpha=-1: PEFTAdapters\(alpha=-1\): LoRA scales its update by alpha / r, so alpha must "
                       r"be a number > 0 .*Fix: alpha=16"),
    "max_bytes_below_the_first_file": ("qwen2", ["data.max_bytes=10", "data.block_size=32"],
                                       r"^data\.max_bytes=10: the first text file \(__init__\.py, [\d,]+ characters\) "
                                       r"uses all of it, so one file is read and none is left for validation \(2 are "
                                       r"needed\)\. Fix: data\.max_bytes=\d+ \(the first two files\) or more"),
    "half_written_safetensors": ("half_written", ["data.block_size=32"],
                                 r"^model\.pretrained=.*half_written: model\.safetensors is damaged or was not written "
                                 r"to its end \(its tensors end at byte [\d,]+, the file has [\d,]+ bytes\), .*Fix: "
                                 r"write or download the folder again, or model\.pretrained=<a complete save_pretrained "
                                 r"folder>$"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_folder_that_cannot_train_is_refused_before_the_weights_load(make_cfg, folders, monkeypatch, case):
    import transformers

    folder, overrides, message = CASES[case]
    loads = []
    original = transformers.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: loads.append(a) or original(*a, **k))
    with pytest.raises(ConfigError, match=message) as error:
        train(make_cfg([*_run(folders[folder], *overrides), *TWO_STEPS]))
    assert "\n" not in str(error.value)
    assert not loads, "the model's weights were loaded before the refusal"


@pytest.mark.parametrize("arch", ["qwen2", "opt"])
def test_the_same_folders_train_within_their_limits(make_cfg, folders, arch):
    # no false refusal: Qwen2's tied embeddings and its tokenizer's added token, OPT's learned positions at 64
    summary = train(make_cfg([*_run(folders[arch], "data.block_size=64"), *TWO_STEPS]))
    assert summary["global_step"] == 2


def test_raising_max_position_embeddings_is_the_fix_that_works_for_rotary_positions(make_cfg, folders, tmp_path):
    import shutil

    folder = shutil.copytree(folders["qwen2"], tmp_path / "qwen2_long")
    config = folder / "config.json"
    config.write_text(config.read_text().replace('"max_position_embeddings": 64', '"max_position_embeddings": 128'))
    summary = train(make_cfg([*_run(folder, "data.block_size=128"), *TWO_STEPS]))
    assert summary["global_step"] == 2


@lru_cache(maxsize=None)
def _script(case: str, folder: str) -> CompletedProcess:
    from tempfile import mkdtemp

    _, overrides, _ = CASES[case]
    return train_script([*_run(Path(folder), *overrides), *TWO_STEPS], Path(mkdtemp(prefix=f"bad_folder_{case}_")),
                        timeout=300)


@pytest.mark.slow  # one fresh interpreter per case (~15 s each)
@pytest.mark.parametrize("case", list(CASES))
def test_the_command_ends_in_one_config_error_line(folders, case):
    proc = _script(case, str(folders[CASES[case][0]]))
    assert proc.returncode == 2, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    lines = re.findall(r"^Config error: (.*)$", proc.stderr, flags=re.M)
    assert len(lines) == 1 and re.search(CASES[case][2], lines[0]), explain(proc)


# ---- issue 50: scripts/plan.py refuses the same inputs as scripts/train.py, in the same one line ----------------------
PLAN_CASES = {**{case: CASES[case] for case in ("base_dtype_int4", "base_dtype_fp8", "alpha_negative",
                                                "max_bytes_below_the_first_file", "half_written_safetensors")},
              "max_steps_negative": ("qwen2", ["trainer.max_steps=-5"],
                                     r"^trainer\.max_steps=-5: a number of optimizer steps >= 1, or -1 for no limit\. "
                                     r"Fix: trainer\.max_steps=5 or trainer\.max_steps=-1$"),
              # (two tracebacks before; train.py said it in one line)
              "pretrained_missing": (None, ["model.pretrained=/nonexistent/model"],
                                     r"^model\.pretrained=/nonexistent/model: HFCausalLM\(pretrained=/nonexistent/model\)"
                                     r": not a local folder.*Fix: model\.pretrained=<a save_pretrained folder>")}


@pytest.mark.parametrize("case", list(PLAN_CASES))
def test_the_planner_refuses_a_bad_input_in_the_same_one_line(folders, capsys, case):
    folder, overrides, message = PLAN_CASES[case]
    assert plan_script().main(_run(folders[folder or "qwen2"], *overrides)) == 2
    err = capsys.readouterr().err
    lines = re.findall(r"^Config error: (.*)$", err, flags=re.M)
    assert "Traceback" not in err and len(lines) == 1 and re.search(message, lines[0]), err[-3000:]


@pytest.mark.slow  # a fresh interpreter that trains a few steps (~20 s)
def test_an_unwritable_cache_folder_is_said_once_and_the_run_goes_on(folders, tmp_path):
    from tests.helpers.fault_scripts.runs import env

    command = [sys.executable, str(ROOT / "scripts" / "train.py"), *_run(folders["qwen2"], "peft=lora",
               "peft.base_dtype=bf16", "data.block_size=32"), *TWO_STEPS, f"hydra.run.dir={tmp_path / 'run'}"]
    # peft.base_compute and peft.up_grad are both timed (auto) and both cached: two writes that fail
    done = subprocess.run(command, cwd=ROOT, env={**env(), "LIT_SPEED_CACHE_DIR": "/proc/lit_speed_cannot_write"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, explain(done)
    said = [line for line in (done.stdout + done.stderr).splitlines() if "cannot be written" in line]
    assert len(said) == 1 and "the timing cache /proc/lit_speed_cannot_write cannot be written" in said[0] \
        and "the run goes on" in said[0], explain(done)
