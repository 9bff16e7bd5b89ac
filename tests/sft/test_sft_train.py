"""data=sft through the runner: a LoRA fine-tune of a tiny chat model on chat examples, its validation a person reads
(loss and perplexity per response token, greedy answers in samples.md) and its export with the chat template."""
from __future__ import annotations

import math

import pytest
import torch

from lit_speed.models.hf_causal_lm import HFCausalLM
from lit_speed.run.config_check import preflight
from lit_speed.run.runner import train


def overrides(model, source, tmp_path, *more):
    return ["model=hf_causal_lm", "data=sft", "peft=lora", "peft.r=4", f"model.pretrained={model}",
            f"data.source={source}", f"data.cache_dir={tmp_path / 'cache'}", "data.max_length=512", "data.batch_size=2",
            "trainer.max_steps=4", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
            "callbacks=[model_checkpoint]", "logger=none", "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false", "optimizer.lr=0.01", *more]


def test_a_chat_fine_tune_validates_per_response_token_writes_samples_and_exports_its_template(
        make_cfg, tmp_path, chat_model, examples):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = overrides(chat_model, examples["chat"], tmp_path, "data.samples=2")
    preflight(args)
    summary = train(make_cfg(args))
    assert summary["global_step"] == 4
    val = summary["final_val"]
    assert val["val/ppl"] == pytest.approx(math.exp(val["val/loss"]), rel=1e-5)
    assert summary["components"]["AccumulationScheduler"]["normalize"] == "tokens"  # auto: the data's loss items
    assert "normalised per auto" in summary["startup"]["accumulation"]
    assert summary["sft_trained_tokens"] > 0 and 0 <= summary["sft_padding_share"] < 0.5
    assert summary["startup"]["loss on"].startswith("responses: ")
    samples = (tmp_path / "samples.md").read_text()
    assert samples.count("## step ") == 2 and "## step 2" in samples and "## step 4" in samples  # no sanity, no repeat
    assert samples.count("| Which module do I import it from? | From the ") == 4  # 2 prompts per validation
    last = summary["components"]["ResponseSamples"]["last"]
    assert len(last) == 2 and {"prompt", "reference", "model"} <= set(last[0])

    folder = tmp_path / "merged" / "hf"
    tokenizer = AutoTokenizer.from_pretrained(folder)  # plain transformers: the template travelled with the model
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(chat_model).chat_template
    merged = AutoModelForCausalLM.from_pretrained(folder)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What does the Python function x() do?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = merged.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]

    adapted = HFCausalLM(str(chat_model))
    from lit_speed.finetune.adapters import add_adapters

    add_adapters(adapted, "lora", ["all-linear"], r=4)
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    adapted.load_state_dict(ckpt["state_dict"], strict=False)
    torch.testing.assert_close(merged(**prompt).logits, adapted(prompt["input_ids"]), rtol=1e-4, atol=1e-4)


def test_an_epoch_packed_and_an_epoch_padded_train_on_the_same_response_tokens(make_cfg, tmp_path, chat_model,
                                                                              examples):
    trained = {}
    for packing in ("true", "false"):
        summary = train(make_cfg(overrides(chat_model, examples["prompt_completion"], tmp_path / packing,
                                           f"data.packing={packing}", "trainer.max_steps=-1", "trainer.max_epochs=1",
                                           "validate=false", "data.samples=0", "peft.export=false",
                                           "trainer.val_check_interval=null")))
        assert summary["startup"]["batching"].startswith("packed" if packing == "true" else "padded")
        trained[packing] = summary["sft_trained_tokens"]
    assert trained["true"] == trained["false"] > 0


@pytest.mark.parametrize("levers", [
    ["peft=head_only"],
    # the slower levers (12-45 s each on 2 cores) in the slow tier: the default tier keeps the cheapest of each kind
    pytest.param(["peft=none", "callbacks=[model_checkpoint,activation_checkpointing,chunked_loss]",
                  "optimizer=adamw8bit"], marks=pytest.mark.slow),
    ["peft.base_dtype=int8", "callbacks=[model_checkpoint,chunked_loss]"],
    pytest.param(["peft.base_dtype=bf16", "precision=bf16-mixed", "callbacks=[model_checkpoint,chunked_loss]"],
                 marks=pytest.mark.slow),
], ids=["head_only", "full+checkpointing+8bit", "int8_base", "bf16_base+bf16-mixed"])
def test_every_fine_tuning_mode_and_memory_lever_trains_on_instruction_data(make_cfg, tmp_path, chat_model, examples,
                                                                          levers):
    keys = {lever.partition("=")[0] for lever in levers}
    other_peft = "peft" in keys  # peft=head_only|none: none of LoRA's keys
    base = overrides(chat_model, examples["chat"], tmp_path, "data.samples=1")
    args = [a for a in base if a.partition("=")[0] not in keys and not (other_peft and a.startswith("peft."))]
    args += levers + ([] if other_peft else ["peft.export=false"])
    summary = train(make_cfg(args))
    assert summary["global_step"] == 4 and math.isfinite(summary["final_val"]["val/loss"])
    assert summary["sft_trained_tokens"] > 0 and summary["startup"]["loss on"].startswith("responses: ")
