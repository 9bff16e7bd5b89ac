"""Checkpointing "decoder-layers" (issue 32): found in any model (Hugging Face, peft-wrapped, the bundled GPT), exact
(same loss and gradients, dropout on), and the analytic bytes per layer equal what autograd saves."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lit_speed.memory.activation_checkpointing import ActivationCheckpointing, checkpoint_modules, restore_modules
from lit_speed.memory.decoder_layers import (
    decoder_layer_activation_bytes,
    decoder_layer_activation_bytes_of,
    decoder_layer_types,
    saved_bytes_per_layer,
)
from lit_speed.models.gpt import GPT, Block
from lit_speed.models.mlp import MLPClassifier
from tests.helpers.memory import TINY_GPT

transformers = pytest.importorskip("transformers", reason="the Hugging Face cases need the finetune extra")


def _llama(layers: int = 3, cls=transformers.LlamaForCausalLM, config=transformers.LlamaConfig, **extra):
    torch.manual_seed(0)
    return cls(config(vocab_size=100, hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, **extra))


def _gpt2_with_dropout():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=100, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                     resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    return transformers.GPT2LMHeadModel(config).train()


class Experts(nn.Module):  # a layer holding a list of experts: the list of layers, not of experts, is the stack
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))

    def forward(self, x):
        return sum(e(x) for e in self.experts)


def test_the_decoder_layers_are_found_whatever_their_class() -> None:
    from peft import LoraConfig, get_peft_model

    assert decoder_layer_types(GPT(**TINY_GPT)) == [Block]
    assert [c.__name__ for c in decoder_layer_types(_llama())] == ["LlamaDecoderLayer"]
    assert [c.__name__ for c in decoder_layer_types(_gpt2_with_dropout())] == ["GPT2Block"]
    lora = get_peft_model(_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    assert [c.__name__ for c in decoder_layer_types(lora)] == ["LlamaDecoderLayer"]
    moe = nn.Sequential(nn.Embedding(4, 8), nn.ModuleList(Experts() for _ in range(3)))
    assert decoder_layer_types(moe) == [Experts]
    with pytest.raises(ValueError, match=r"modules=\[decoder-layers\]: MLPClassifier has no decoder layers .*Fix: "
                                         r"name the block class to checkpoint, e.g\. modules=\[Block\]"):
        decoder_layer_types(MLPClassifier(in_features=64, num_classes=10, hidden=32, depth=1))


def _loss_and_grads(model: nn.Module, x: torch.Tensor, seed: int = 3) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks in both runs (checkpointing replays its saved RNG state)
    loss = model(input_ids=x, labels=x, use_cache=False).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("build", [_gpt2_with_dropout, "lora"], ids=["gpt2-dropout", "llama-lora"])
def test_checkpointing_the_decoder_layers_keeps_loss_and_gradients(build) -> None:
    if build == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    else:
        model = build()
    x = torch.randint(0, 100, (2, 24))
    plain = _loss_and_grads(model, x)
    assert len(checkpoint_modules(model, ["decoder-layers"])) in (2, 3)
    checkpointed = _loss_and_grads(model, x)
    # float32, no tolerance: the recompute runs the same ops in the same order on the same inputs and RNG state
    torch.testing.assert_close(checkpointed[0], plain[0], rtol=0, atol=0)
    for a, b in zip(checkpointed[1], plain[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    restore_modules(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-true"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_analytic_bytes_per_layer_equal_what_autograd_saves(dtype, family) -> None:
    build = {"llama": {}, "qwen2": {"cls": transformers.Qwen2ForCausalLM, "config": transformers.Qwen2Config}}[family]
    model = _llama(**build).to(dtype)
    x = torch.randint(0, 100, (2, 32))
    measured = saved_bytes_per_layer(model, lambda: model(input_ids=x, use_cache=False).logits)
    estimate = decoder_layer_activation_bytes_of(model.config, tokens=x.numel(), dtype=dtype)
    # layer 0 also keeps the rotary tables all layers share; the others keep exactly their own activations
    assert list(measured.values())[1:] == [estimate.kept] * 2
    checkpoint_modules(model, ["decoder-layers"])
    checkpointed = saved_bytes_per_layer(model, lambda: model(input_ids=x, use_cache=False).logits)
    assert list(checkpointed.values()) == [estimate.checkpointed] * 3  # each layer keeps its input only
    assert estimate.total(24, checkpointing=True) == 24 * estimate.checkpointed + estimate.kept


def test_the_estimate_at_real_size_names_what_checkpointing_saves() -> None:
    # Qwen2.5-0.5B's layer (hidden 896, MLP 4864, 14 heads / 2 KV heads), micro-batch 4 x 512 tokens, float32
    layer = decoder_layer_activation_bytes(896, 4864, 14, 2, tokens=4 * 512)
    assert layer.checkpointed == 896 * 2048 * 4
    assert 20 < layer.kept / layer.checkpointed < 40  # a checkpointed layer keeps ~1/30 of its activations (1/30.0)
    assert layer.saved == layer.kept - layer.checkpointed


def test_hugging_face_checkpointing_does_nothing_on_a_model_in_eval_mode_and_ours_does() -> None:
    model = _llama().eval()  # what from_pretrained returns, and Lightning 2.6 keeps
    x = torch.randint(0, 100, (2, 32))
    plain = sum(saved_bytes_per_layer(model, lambda: model(input_ids=x, use_cache=False).logits).values())
    model.activation_checkpointing_enable()
    theirs = sum(saved_bytes_per_layer(model, lambda: model(input_ids=x, use_cache=False).logits).values())
    model.activation_checkpointing_disable()
    checkpoint_modules(model, ["decoder-layers"])
    ours = sum(saved_bytes_per_layer(model, lambda: model(input_ids=x, use_cache=False).logits).values())
    assert theirs == plain and ours < plain / 10


def test_the_callback_checkpoints_an_hf_lightning_module_by_default(tmp_path) -> None:
    import lightning.pytorch as pl

    from lit_speed.models.hf_causal_lm import HFCausalLM
    from tests.helpers.tiny_hf import save_tiny_causal_lm

    folder = save_tiny_causal_lm(tmp_path / "hf", "llama", layers=2)
    module = HFCausalLM(str(folder), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    tokens = torch.randint(0, 200, (8, 17))
    loader = torch.utils.data.DataLoader(list(zip(tokens[:, :-1], tokens[:, 1:])), batch_size=4)
    callback = ActivationCheckpointing()
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
                         callbacks=[callback])
    trainer.fit(module, train_dataloaders=loader)
    assert callback.wrapped == ["model.model.layers.0", "model.model.layers.1"]
    assert callback.describe()["activation checkpointing"].startswith("decoder-layers (2 wrapped)")
