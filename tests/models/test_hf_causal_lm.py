"""A Hugging Face causal LM through the Hydra entry: its own tokenizer feeds a text folder (tokenized once),
LoRA on it, a merged save_pretrained folder that transformers loads alone with the same outputs."""
from __future__ import annotations

import json

import pytest
import torch

from lit_speed.data.text_folder import TextFolderDataModule, build_token_corpus
from lit_speed.models.hf_causal_lm import HFCausalLM
from lit_speed.run.runner import train
from tests.helpers.fault_scripts.runs import explain
from tests.helpers.fault_scripts.runs import train as run_script
from tests.helpers.tiny_hf import save_tiny_causal_lm, tiny_tokenizer, write_texts


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return save_tiny_causal_lm(tmp_path_factory.mktemp("hf") / "tiny_llama", "llama", seed=0)


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    return write_texts(tmp_path_factory.mktemp("texts"))


def _run(hf_folder, texts, *extra):
    return ["model=hf_causal_lm", "data=text_folder", f"model.pretrained={hf_folder}", f"data.root={texts}",
            "data.block_size=32", "data.batch_size=4", "data.val_every=3", "trainer.max_steps=8",
            "trainer.val_check_interval=4", "trainer.check_val_every_n_epoch=null", "trainer.limit_val_batches=1",
            "trainer.num_sanity_val_steps=0", "callbacks=[model_checkpoint]", "logger=none", "validate=false",
            "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", *extra]


class CountingTokenizer:
    """Wraps a tokenizer and counts the texts it tokenized."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0
        self.eos_token_id, self.backend_tokenizer = inner.eos_token_id, inner.backend_tokenizer

    def __call__(self, text, **kwargs):
        self.calls += 1
        return self.inner(text, **kwargs)

    def __len__(self):
        return len(self.inner)


def test_text_folder_is_tokenized_once_then_read_from_the_cache(tmp_path, texts):
    tokenizer = CountingTokenizer(tiny_tokenizer())
    first = build_token_corpus(tmp_path, tokenizer, texts, val_every=3)
    assert tokenizer.calls == 6 and first.meta["train_files"] == 4 and first.meta["val_files"] == 2
    again = build_token_corpus(tmp_path, tokenizer, texts, val_every=3)
    assert tokenizer.calls == 6 and again.train_path == first.train_path  # the cache: not tokenized again
    ids = torch.from_numpy(first.train_tokens().view("uint16").astype("int64")) if first.meta["dtype"] == "uint16" \
        else None
    text = (texts / "bisect.py.txt").read_text()
    expected = tokenizer.inner(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert ids[: len(expected)].tolist() == expected  # sorted order: bisect.py is the first file, then <eos>
    (texts / "bisect.py.txt").write_text(text + "\n# changed\n")
    try:
        assert build_token_corpus(tmp_path, tokenizer, texts, val_every=3).train_path != first.train_path
    finally:
        (texts / "bisect.py.txt").write_text(text)


def test_text_folder_serves_token_windows_of_the_model_vocabulary(tmp_path, texts, hf_folder):
    dm = TextFolderDataModule(str(texts), str(hf_folder), str(tmp_path), block_size=32, batch_size=4, val_every=3)
    dm.setup("fit")
    x, y = dm.train_dataset[0]
    assert x.shape == y.shape == (32,) and x.dtype == torch.int64 and torch.equal(x[1:], y[:-1])
    assert int(x.max()) < len(dm.tokenizer)
    with pytest.raises(FileNotFoundError, match=r"TextFolderDataModule\(root=.*\): no such folder\. Fix: data\.root="):
        TextFolderDataModule(str(tmp_path / "none"), str(hf_folder), str(tmp_path)).setup("fit")


def test_lora_on_an_hf_model_trains_and_exports_a_folder_transformers_loads_alone(make_cfg, tmp_path, hf_folder, texts):
    from transformers import AutoModelForCausalLM

    summary = train(make_cfg(_run(hf_folder, texts, "peft=lora", "peft.r=4", "peft.target_modules=[q_proj,v_proj]")))
    peft = summary["components"]["PEFTAdapters"]
    assert peft["target_modules"] == 4  # q_proj and v_proj in 2 layers
    assert peft["trainable_params"] == 2 * 4 * ((64 + 64) + (64 + 32))  # q: 64 -> 64, v: 64 -> 32 (2 KV heads)
    assert summary["global_step"] == 8 and "HFCausalLM" in summary["startup"]["model"]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged" / "hf")  # no lit_speed, no peft
    adapted = HFCausalLM(str(hf_folder))
    from lit_speed.finetune.adapters import add_adapters

    add_adapters(adapted, "lora", ["q_proj", "v_proj"], r=4)
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    adapted.load_state_dict(ckpt["state_dict"], strict=False)  # the adapters onto the same pretrained base
    x = torch.randint(0, adapted.model.config.vocab_size, (2, 24))
    torch.testing.assert_close(merged(input_ids=x).logits, adapted(x), rtol=1e-4, atol=1e-4)
    assert (tmp_path / "merged" / "hf" / "tokenizer.json").is_file()


def test_full_fine_tuning_exports_the_trained_model_as_a_folder_transformers_loads_alone(make_cfg, tmp_path, hf_folder,
                                                                                       texts):
    """peft=none (every parameter trains) ends as the Trainer's save_model ends: a save_pretrained folder with the
    tokenizer, holding the trained weights (those of last.ckpt), not the pretrained ones."""
    from transformers import AutoModelForCausalLM

    summary = train(make_cfg(_run(hf_folder, texts)))
    export = summary["components"]["ExportModel"]
    assert export["exported"] == {"hf": str(tmp_path / "model" / "hf")} and export["export_s"] > 0
    assert summary["time_split_s"]["export"] == pytest.approx(export["export_s"], abs=0.01)
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "model" / "hf")  # no lit_speed
    assert (tmp_path / "model" / "hf" / "tokenizer.json").is_file()
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    pretrained = AutoModelForCausalLM.from_pretrained(hf_folder)
    for name, value in trained.state_dict().items():
        torch.testing.assert_close(value, ckpt[f"model.{name}"], rtol=0, atol=0)
    moved = [n for n, v in trained.state_dict().items() if not torch.equal(v, pretrained.state_dict()[n])]
    assert len(moved) == len(trained.state_dict())  # every weight trained


def test_full_fine_tuning_with_export_false_writes_no_model_folder(make_cfg, tmp_path, hf_folder, texts):
    summary = train(make_cfg(_run(hf_folder, texts, "trainer.max_steps=4", "peft.export=false")))
    assert not (tmp_path / "model").exists() and summary["components"]["ExportModel"]["exported"] == {}
    assert summary["components"]["ExportModel"]["reason"] == "off (peft.export=false)"


def test_full_fine_tuning_of_an_hf_model_with_activation_checkpointing_by_block_class(make_cfg, hf_folder, texts):
    summary = train(make_cfg(_run(hf_folder, texts, "callbacks=[activation_checkpointing]",
                                  "callbacks.activation_checkpointing.modules=[LlamaDecoderLayer]",
                                  "accumulation=fixed", "accumulation.factors=[[0,2]]")))
    assert summary["global_step"] == 8 and summary["components"]["ActivationCheckpointing"]["wrapped_modules"] == 2


def test_full_fine_tuning_with_8bit_states_and_the_decoder_layers_checkpointed(make_cfg, hf_folder, texts, tmp_path):
    pytest.importorskip("torchao", reason="optimizer=adamw8bit is torchao's (pip install -e '.[finetune]')")
    summary = train(make_cfg(_run(hf_folder, texts, "callbacks=[model_checkpoint,activation_checkpointing]",
                                  "optimizer=adamw8bit")))
    assert summary["global_step"] == 8 and summary["components"]["ActivationCheckpointing"]["wrapped_modules"] == 2
    assert summary["startup"]["optimizer"].startswith("AdamW8bit(lr=0.001, block_size=256)")
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["optimizer_states"][0]["state"]
    assert any(isinstance(s["exp_avg"], dict) and s["exp_avg"]["bits"] == 8 for s in state.values())


def test_a_model_folder_that_does_not_exist_is_one_line(make_cfg, tmp_path, texts):
    from lit_speed.run.config_error import ConfigError

    with pytest.raises(ConfigError, match=r"model\.pretrained=.*HFCausalLM\(pretrained=.*nowhere\): not a local folder"):
        train(make_cfg(_run(tmp_path / "nowhere", texts)))


@pytest.mark.slow
def test_hf_model_trains_through_train_py_with_bf16_mixed_accumulation_and_zero2(tmp_path, hf_folder, texts):
    args = _run(hf_folder, texts, "precision=bf16-mixed", "accumulation=fixed", "accumulation.factors=[[0,2]]",
                "strategy=zero2", "peft=lora", "peft.r=4", "validate=true")
    done = run_script(args, tmp_path / "run")
    assert done.returncode == 0, explain(done)
    import json

    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["global_step"] == 8 and summary["startup"]["precision"] == "bf16-mixed"
    assert "ZeroStrategy" in summary["startup"]["strategy"] and "2 accumulation" in summary["startup"]["effective batch"]
    assert summary["final_val"]["val/loss"] < 20 and (tmp_path / "run" / "merged" / "hf" / "model.safetensors").is_file()


def test_hf_lora_under_bf16_master_with_device_stats_and_fault_tolerance(make_cfg, tmp_path, hf_folder, texts):
    args = [a for a in _run(hf_folder, texts) if not a.startswith("callbacks=")]
    summary = train(make_cfg([*args, "callbacks=default", "precision=bf16-master", "peft=lora", "peft.r=4"]))
    assert summary["global_step"] == 8 and summary["startup"]["precision"] == "bf16-master"
    evidence = summary["components"]["DeviceStatsLogger"]["evidence"]
    assert evidence["flops_per_sec"] > 0 and 0 < evidence["mfu"] < 1  # FLOPs counted on the HF model's first batch
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["adapters_only"] and all(v.dtype == torch.float32 for v in ckpt["state_dict"].values())  # masters


def _dropout_probe():
    import lightning.pytorch as pl

    class Probe(pl.Callback):
        def __init__(self):
            self.train_modes, self.val_modes, self.dropouts = set(), set(), 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            found = [m.training for m in pl_module.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
            self.dropouts = len(found)
            self.train_modes.update(found)

        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            self.val_modes.update(m.training for m in pl_module.modules() if isinstance(m, torch.nn.Dropout))

    return Probe()


@pytest.mark.parametrize("peft", ["none", "lora"])
def test_a_pretrained_hf_model_trains_with_its_dropout_and_validates_in_eval_mode(make_cfg, tmp_path, texts, peft,
                                                                                   recwarn):
    """from_pretrained returns a model in eval mode and Lightning keeps module modes: GPT-2's dropout (0.1 in its
    config) must be on in training batches and off in validation, with no eval-mode warning from Lightning."""
    from lit_speed.run import runner

    folder = save_tiny_causal_lm(tmp_path / "tiny_gpt2", "gpt2", seed=0)
    probe = _dropout_probe()
    build = runner.build

    def build_with_probe(cfg):
        parts = build(cfg)
        parts["trainer"].callbacks.append(probe)
        return parts

    runner.build = build_with_probe
    try:
        train(make_cfg(_run(folder, texts, f"peft={peft}", "trainer.max_steps=4", "trainer.val_check_interval=2")))
    finally:
        runner.build = build
    assert probe.dropouts > 0  # GPT-2's attention, residual and embedding dropout (p=0.1)
    assert probe.train_modes == {True}, "dropout was off in a training batch"
    assert probe.val_modes == {False}, "dropout was on in a validation batch"
    assert not [w for w in recwarn if "eval mode at the start of training" in str(w.message)]


def test_summary_splits_launch_to_end_into_phases_that_add_up(tmp_path, hf_folder, texts):
    """summary.json's time_split_s: every phase of a LoRA run through scripts/train.py (start-up before the runner,
    checks, model load, adapters, data, sanity, training, validation, checkpoints, export, final validation), each
    >= 0, the ones this run has > 0, and together the seconds from launch to the summary."""
    import time

    args = [a for a in _run(hf_folder, texts, "peft=lora") if not a.startswith((
        "validate=", "trainer.num_sanity_val_steps="))] + ["validate=true", "trainer.num_sanity_val_steps=1"]
    start = time.time()
    result = run_script(args, tmp_path)
    outside = time.time() - start
    assert result.returncode == 0, explain(result)
    summary = json.loads((tmp_path / "summary.json").read_text())
    split = summary["time_split_s"]
    expected = {"startup", "checks", "model_load", "model_prepare", "build", "data", "fit_setup", "sanity", "training",
                "validation", "checkpoints", "export", "final_validation", "other"}
    assert expected <= split.keys(), split
    assert all(v >= 0 for v in split.values()), split
    # what this run did took time: imports, a model from disk, 8 steps, 2 validations, 2 checkpoints, one export
    assert all(split[k] > 0 for k in ("startup", "model_load", "model_prepare", "training", "sanity", "validation",
                                      "checkpoints", "export")), split
    # the second validation was at the last step: the final validation is that one (same weights), not run again
    assert split["final_validation"] == 0 and summary["final_val_from"] == "the fit's validation at step 8", summary
    assert abs(sum(split.values()) - summary["launch_to_end_s"]) < 0.02 * len(split)  # rounding of each phase
    # the process's own clock, inside the wall time seen from outside (its start is known to a clock tick, 10 ms)
    assert summary["launch_to_end_s"] <= outside + 0.01
    assert summary["steady_tokens_per_sec"] > 0 and summary["median_batch_s"] > 0
    assert "launch to end" in result.stdout


def test_auto_validation_reads_five_percent_of_the_training_tokens_one_window_per_process_to_256():
    from types import SimpleNamespace

    from lit_speed.data.text_folder import auto_val_windows, planned_training_tokens

    steps = SimpleNamespace(max_steps=3, max_epochs=20, accumulate_grad_batches=1, world_size=1)
    assert planned_training_tokens(steps, batch_size=4, block_size=512, train_windows=10_000) == 3 * 4 * 512
    assert auto_val_windows(3 * 4 * 512, 512) == 1  # a 3-step run: 5% is under a window: one window, never none
    assert auto_val_windows(3 * 4 * 512, 512, processes=2) == 2  # ... one window on each of two processes
    assert auto_val_windows(20 * 4 * 512, 512) == 4  # 5% of 40,960 tokens: 4 windows, one batch of 4
    assert auto_val_windows(100 * 4 * 512, 512, processes=2) == 20  # 5% of 204.8k tokens, above the floor
    assert auto_val_windows(2000 * 4 * 512, 512) == 256  # a long run: the full set
    assert auto_val_windows(1000 * 4 * 512, 512) == 200  # 5% of 2.05M tokens in 512-token windows
    assert auto_val_windows(None, 512) == 256  # only max_time stops it: the plan is unknown
    epochs = SimpleNamespace(max_steps=-1, max_epochs=2, accumulate_grad_batches=2, world_size=2)
    assert planned_training_tokens(epochs, 4, 64, train_windows=100) == 2 * 25 * 4 * 64 * 2 * 2 // 2


def test_text_folder_validates_auto_windows_in_micro_batches_and_refuses_a_bad_count(tmp_path, texts, hf_folder):
    from types import SimpleNamespace

    dm = TextFolderDataModule(str(texts), str(hf_folder), str(tmp_path / "cache"), block_size=16, batch_size=3)
    dm.setup()
    dm.trainer = SimpleNamespace(max_steps=4, max_epochs=20, accumulate_grad_batches=1, world_size=1)
    loader = dm.val_dataloader()
    assert len(dm.val_dataset) == 1 and loader.batch_size == 3  # 5% of 4 x 3 x 16 tokens is under a window: one
    assert len(loader) == 1
    dm.trainer = SimpleNamespace(max_steps=4, max_epochs=20, accumulate_grad_batches=1, world_size=2)
    dm.val_dataloader()
    assert len(dm.val_dataset) == 2  # one window on each of two processes
    dm.trainer = SimpleNamespace(max_steps=100, max_epochs=20, accumulate_grad_batches=1, world_size=1)
    loader = dm.val_dataloader()
    assert len(dm.val_dataset) == 15 and len(loader) == 5  # 5% of 100 x 3 x 16 tokens: 15 windows in batches of 3
    assert "auto: 5% of the training tokens" in dm.describe()["validation"]
    with pytest.raises(ValueError, match=r"max_val_windows='many'.*Fix: max_val_windows=auto"):
        TextFolderDataModule(str(texts), str(hf_folder), str(tmp_path), max_val_windows="many")

def test_an_empty_tokenizer_is_refused_naming_the_folder_and_data_tokenizer(tmp_path):
    # transformers 5 builds a 1-token tokenizer from a model folder without tokenizer files instead of raising
    from lit_speed.data.text_folder import load_tokenizer

    folder = save_tiny_causal_lm(tmp_path / "weights_only", "qwen2", tokenizer=False)
    with pytest.raises(ValueError, match=rf"TextFolderDataModule\(tokenizer={folder}\): no usable tokenizer there: "
                                         r"transformers built \w+ with 1 token\(s\), and 'The quick brown fox'\.\.\. "
                                         r"encodes to no ids; the folder has no tokenizer file .*Fix: data\.tokenizer="):
        load_tokenizer(str(folder))


def test_model_and_data_say_their_token_limits_before_the_weights_load(tmp_path, texts):
    from lit_speed.run_contract import TokenLimits, TokenModel, TokenSource

    folder = save_tiny_causal_lm(tmp_path / "opt", "opt", max_positions=64)
    assert isinstance(HFCausalLM, TokenModel)
    limits = HFCausalLM.input_limits({"pretrained": str(folder)})
    assert limits == TokenLimits(len(tiny_tokenizer()), 64, f"pretrained={folder}", "learned", "OPTForCausalLM")
    assert HFCausalLM.input_limits({"pretrained": str(tmp_path / "nothing")}) is None  # the model's build says why
    data = TextFolderDataModule(str(texts), tokenizer=str(folder), cache_dir=str(tmp_path / "cache"), block_size=48)
    assert isinstance(data, TokenSource)
    assert data.token_limits() == TokenLimits(len(tiny_tokenizer()), 48, f"tokenizer={folder}",
                                              positions_source="block_size=48")


def test_a_gpt_smaller_than_the_character_vocabulary_is_refused_naming_its_setting(make_cfg):
    from lit_speed.run.config_error import ConfigError

    with pytest.raises(ConfigError, match=r"^model\.vocab_size=50: the data's ids come from the fixed 97-character "
                                          r"vocabulary \(97 ids\), the embedding of GPT has 50 rows \(model\.vocab_size="
                                          r"50\): ids 50 to 96 would index outside it .*Fix: model\.vocab_size=97$"):
        train(make_cfg(["experiment=charlm_cpu", "model.vocab_size=50", "data.max_bytes=100000"]))
    with pytest.raises(ConfigError, match=r"^data\.block_size=64: longer than the 32 positions of GPT \(model\."
                                          r"block_size=32\): .*learned table of 32 rows.*Fix: data\.block_size=32"):
        train(make_cfg(["experiment=charlm_cpu", "model.block_size=32", "data.max_bytes=100000"]))


def test_a_bf16_folder_read_in_bf16_for_a_bf16_base_is_the_model_read_in_float32_then_lowered(tmp_path):
    # peft.base_dtype=bf16 reads a bf16 folder in bf16 (model.load_dtype): no float32 copy of the whole base while
    # loading; after PEFTAdapters every tensor must be what the float32 read then lowered gives, the fingerprint too
    from transformers import AutoModelForCausalLM

    from lit_speed.finetune.peft_callback import PEFTAdapters

    folder = save_tiny_causal_lm(tmp_path / "fp32", "qwen2", seed=3, tokenizer=False)
    AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    models, fingerprints = [], []
    for load_dtype in (None, "bf16"):
        torch.manual_seed(0)
        model = HFCausalLM(str(tmp_path / "bf16"), load_dtype=load_dtype)
        adapters = PEFTAdapters(r=4, base_dtype="bf16", export=False)
        adapters.prepare_model(model)
        model.setup("fit")
        models.append(model)
        fingerprints.append(adapters.base_fingerprint)
    assert not getattr(models[0], "loaded_low_precision") and models[1].loaded_low_precision
    a, b = (dict(m.state_dict()) for m in models)
    assert list(a) == list(b) and all(a[k].dtype == b[k].dtype for k in a)
    trainable = {n for n, p in models[1].named_parameters() if p.requires_grad}
    assert [k for k in a if k not in trainable and not torch.equal(a[k], b[k])] == []  # the base: bitwise
    # peft draws the adapters' initial values in float32 and casts them to the base layer's dtype: read in bf16,
    # they start as the float32 read's values rounded to bf16 (then train in float32)
    assert all(torch.equal(b[k], a[k].bfloat16().float()) for k in trainable)
    assert {p.dtype for p in models[1].parameters() if p.requires_grad} == {torch.float32}
    assert fingerprints[0] == fingerprints[1]
    # a float32 folder is read in float32 whatever load_dtype says (nothing is rounded on the way in)
    assert not HFCausalLM(str(folder), load_dtype="bf16").loaded_low_precision


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_lora_with_the_decoder_layers_compiled_trains_as_eager_validates_and_exports(make_cfg, tmp_path, hf_folder,
                                                                                    texts, backend):
    """callbacks=compile on a Hugging Face model with LoRA and the chunked loss (the real-size speed rows): the same
    losses as eager, the eval-mode validation and the merged export run through the compiled layers."""
    from transformers import AutoModelForCausalLM

    from tests.helpers.repo import compose_config

    lora = ["peft=lora", "peft.r=4", "peft.target_modules=[q_proj,v_proj,down_proj]"]
    eager = train(compose_config(_run(hf_folder, texts, *lora, "callbacks=[model_checkpoint,chunked_loss]"),
                                 tmp_path / "eager"))
    compiled = train(compose_config(_run(hf_folder, texts, *lora, "callbacks=[model_checkpoint,chunked_loss,compile]",
                                         f"callbacks.compile.backend={backend}"), tmp_path / "compiled"))
    assert compiled["components"]["CompileModel"]["compiled_modules"] == 2  # the 2 decoder layers
    assert compiled["global_step"] == eager["global_step"] == 8
    tolerance = 1e-6 if backend == "aot_eager" else 1e-4  # inductor fuses, so sums run in another order
    assert compiled["final_train_loss"] == pytest.approx(eager["final_train_loss"], rel=tolerance)
    assert compiled["final_metrics"]["val/loss"] == pytest.approx(eager["final_metrics"]["val/loss"], rel=tolerance)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "compiled" / "merged" / "hf")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "eager" / "merged" / "hf")
    x = torch.randint(0, merged.config.vocab_size, (2, 24))
    torch.testing.assert_close(merged(input_ids=x).logits, reference(input_ids=x).logits, rtol=tolerance * 10,
                               atol=tolerance * 10)
