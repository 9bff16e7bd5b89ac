"""Start from weights: the four sources load into the model, a tensor that does not fit is named, loading is safe."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_model

from lit_speed.finetune.init_callback import InitWeights
from lit_speed.finetune.weights import load_weights, read_state_dict
from lit_speed.models.gpt import GPTModule
from lit_speed.run.config_error import ConfigError
from lit_speed.run.runner import build, train
from tests.helpers.tiny_hf import save_tiny_causal_lm

SIZES = {"vocab_size": 97, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}


def _gpt(seed: int, **sizes) -> GPTModule:
    torch.manual_seed(seed)
    return GPTModule(**{**SIZES, **sizes})


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("kind", ["lightning checkpoint", "state_dict", "safetensors"])
def test_each_file_kind_initialises_the_model_exactly(tmp_path, kind):
    source, target = _gpt(1), _gpt(2)
    assert not _same(source, target)
    if kind == "lightning checkpoint":  # optimizer and loop state are there, and ignored
        path = tmp_path / "last.ckpt"
        torch.save({"state_dict": source.state_dict(), "optimizer_states": [{"state": {}}], "global_step": 7}, path)
    elif kind == "state_dict":  # the inner GPT's keys: "model." is added to match GPTModule's
        path = tmp_path / "gpt.pt"
        torch.save(source.model.state_dict(), path)
    else:  # save_model drops the tied lm_head.weight: it counts as loaded through wte.weight
        path = tmp_path / "model.safetensors"
        save_model(source, str(path))
    report = load_weights(target, path, strict=True)
    assert _same(source, target)
    assert report.kind == kind and report.loaded == report.model_tensors == len(target.state_dict())
    assert report.prefix_added == ("model." if kind == "state_dict" else "")


def test_a_hugging_face_folder_initialises_an_hf_model(tmp_path):
    from lit_speed.models.hf_causal_lm import HFCausalLM

    folder = save_tiny_causal_lm(tmp_path / "hf", "llama", seed=3)
    fresh = HFCausalLM(str(folder), from_config=True)  # same architecture, other random weights
    pretrained = HFCausalLM(str(folder))
    assert not _same(fresh, pretrained)
    report = load_weights(fresh, folder)
    assert report.kind == "hugging face folder" and report.prefix_added == "model."
    assert _same(fresh, pretrained)


def test_a_mismatched_tensor_is_named_in_one_line(tmp_path):
    path = tmp_path / "wide.pt"
    torch.save(_gpt(1, n_embd=64).state_dict(), path)
    with pytest.raises(ValueError, match=r"InitWeights\(path=.*wide\.pt\): model\.wte\.weight is \(97, 64\) in "
                                         r"the file, \(97, 32\) in GPTModule: .*another size\. Fix: "):
        load_weights(_gpt(2), path)


def test_strict_names_the_first_missing_tensor_and_non_strict_keeps_it(tmp_path):
    source, target = _gpt(1), _gpt(2)
    before = target.state_dict()["model.ln_f.weight"].clone()
    state = {k: v for k, v in source.state_dict().items() if not k.startswith("model.ln_f")}
    path = tmp_path / "partial.pt"
    torch.save(state, path)
    with pytest.raises(ValueError, match=r"1 of GPTModule's \d+ tensors are not in the file, the first is "
                                         r"model\.ln_f\.weight.*Fix: .*strict=false"):
        load_weights(target, path, strict=True)
    report = load_weights(target, path, strict=False)
    assert report.missing == ("model.ln_f.weight",) and not report.strict
    assert torch.equal(target.state_dict()["model.ln_f.weight"], before)  # kept as initialised
    assert torch.equal(target.state_dict()["model.wte.weight"], source.state_dict()["model.wte.weight"])
    assert "non-strict" in report.describe()


def test_a_file_that_would_run_code_is_refused_without_running_it(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.zeros(1), "payload": torch.nn.ReLU()}, path)  # a module object: not weights-only
    with pytest.raises(ValueError, match=r"cannot be loaded safely \(torch\.load weights_only=True refused it"):
        read_state_dict(path)


def test_missing_path_and_folder_without_weights_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no such file or folder\. Fix: path="):
        read_state_dict(tmp_path / "nope.pt")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"not a Hugging Face model folder .*it holds notes\.txt"):
        read_state_dict(tmp_path)


def test_init_weights_through_the_runner_loads_before_the_table_and_states_strictness(make_cfg, tmp_path):
    overrides = ["experiment=charlm_cpu", "model.n_layer=2", "model.n_embd=32", "model.n_head=2",
                 "data.max_bytes=100000", "data.block_size=16"]
    source = build(make_cfg(overrides))["model"]
    torch.nn.init.normal_(source.model.wte.weight)  # not what seed 42 would give
    path = tmp_path / "weights.pt"
    torch.save(source.state_dict(), path)
    parts = build(make_cfg([*overrides, "init=weights", f"init.path={path}"]))
    assert _same(parts["model"], source)
    init = next(cb for cb in parts["callbacks"] if isinstance(cb, InitWeights))
    assert init.describe()["init weights"].endswith(f"{init.report.loaded}/{init.report.model_tensors} tensors, strict")


def test_a_wrong_init_file_is_a_config_error_before_anything_runs(make_cfg, tmp_path):
    path = tmp_path / "mlp.pt"
    torch.save({"net.0.weight": torch.zeros(3, 3)}, path)
    with pytest.raises(ConfigError, match=r"InitWeights\(path=.*mlp\.pt\): net\.0\.weight is \(3, 3\) in the file, "
                                          r"\(256, 64\) in MLPClassifier"):
        train(make_cfg(["init=weights", f"init.path={path}", "trainer.max_epochs=1", "logger=none"]))
