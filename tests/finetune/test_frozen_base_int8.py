"""A frozen base held in int8 under adapters (``peft.base_dtype=int8``): a quarter of the float32 bytes plus one
float32 scale per output channel, every weight within half a quantization step, the adapters' loss and gradients
equal to a float32 model holding the dequantized values, tied weights quantized once (an LM head and its
embedding share rows and scales), GPT-2's ``Conv1D`` quantized per output column, a float32 export equal to
merging by hand into the dequantized base, and the fit check counting one byte per frozen weight."""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from lit_speed.finetune.frozen_base import dequantized, frozen_base_bytes, int8_scales, lower_frozen_base
from lit_speed.finetune.peft_callback import PEFTAdapters
from tests.finetune.test_frozen_base import _fit, _lora_gpt, _lora_grads


def _dequantized_copy(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (before lowering) with every frozen matrix replaced by what the int8 base holds, in float32."""
    reference = copy.deepcopy(model)
    lowered = copy.deepcopy(model)
    lower_frozen_base(lowered, torch.int8)
    scales = int8_scales(lowered)
    frozen = {n: p for n, p in lowered.named_parameters() if id(p) in scales}
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name in frozen:
                p.copy_(dequantized(frozen[name], scales[id(frozen[name])], torch.float32))
    return reference


def test_int8_holds_a_quarter_of_the_bytes_and_every_weight_within_half_a_step():
    model = _lora_gpt()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    before, held = frozen_base_bytes(model, torch.int8)
    lowered = lower_frozen_base(model, torch.int8)
    assert model.model.lm_head.weight is model.model.wte.weight and model.model.wte.weight.dtype == torch.int8
    scales = int8_scales(model)
    # wte(=lm_head) + wpe + 4 base Linear weights per block x 2 blocks; the tied head shares the embedding's scales
    assert lowered.tensors == 10 == len(scales)
    assert model.model.lm_head.held_weight_scale is model.model.wte.held_weight_scale
    rows = sum(s.numel() for s in scales.values())
    assert lowered.bytes_before == before and held == before // 4 and lowered.bytes_after == held + 4 * rows
    for name, p in model.named_parameters():
        if id(p) in scales:
            error = (dequantized(p, scales[id(p)], torch.float32) - original[name]).abs()
            assert float((error - scales[id(p)] / 2).max()) <= 1e-7, name  # round to nearest: half a step
            assert int(p.abs().max()) == 127  # absmax: each channel's largest weight is +-127 steps
        else:
            assert p.dtype == torch.float32 and torch.equal(p, original[name])  # adapters, biases, norms


def test_fp32_compute_over_int8_equals_a_float32_model_holding_the_dequantized_values():
    model = _lora_gpt()
    reference = _dequantized_copy(model)
    lower_frozen_base(model, torch.int8, compute="fp32")
    loss, grads = _lora_grads(model)
    ref_loss, ref_grads = _lora_grads(reference)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == ref_grads.keys() and all("lora_" in n for n in grads)
    for name, grad in grads.items():
        assert grad.dtype == torch.float32
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6)
    # and the rounding is small against the float32 base itself
    base_loss, _ = _lora_grads(_lora_gpt())
    torch.testing.assert_close(loss, base_loss, rtol=1e-2, atol=1e-2)


def test_gpt2_conv1d_is_quantized_per_output_column_and_its_input_gradient_is_the_dequantized_one():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    layer = Conv1D(24, 16)  # y = x @ W + b, W [in=16, out=24]
    layer.weight.requires_grad_(False)
    reference = copy.deepcopy(layer)
    lower_frozen_base(torch.nn.Sequential(layer), torch.int8)
    scale = layer.held_weight_scale
    assert layer.weight.dtype == torch.int8 and scale.shape == (1, 24)  # one scale per output column
    with torch.no_grad():
        reference.weight.copy_(layer.weight.float() * scale)
    x = torch.randn(3, 16, requires_grad=True)
    y = layer(x)
    (grad,) = torch.autograd.grad(y.square().sum(), x)
    x_ref = x.detach().clone().requires_grad_()
    y_ref = reference(x_ref)
    (grad_ref,) = torch.autograd.grad(y_ref.square().sum(), x_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-6, atol=1e-6)


def test_trains_fp32_adapters_over_an_int8_base_and_exports_float32_equal_to_merging_by_hand(tmp_path):
    _, _, plain_losses = _fit(PEFTAdapters(r=4, export=False), tmp_path / "plain")
    # base_compute named: under auto the faster of fp32/bf16 is timed on the machine (bf16 won on CI's CPU once),
    # and this test is about float32 compute over the int8 base (auto's choice: test_frozen_base.py)
    callback = PEFTAdapters(r=4, base_dtype="int8", base_compute="fp32", export=True,
                            export_dir=str(tmp_path / "merged"))
    module, trainer, losses = _fit(callback, tmp_path / "int8")
    assert module.model.wte.weight.dtype == torch.int8 and callback.chosen_compute == "fp32"
    assert callback.compute_reason == "requested"
    state = trainer.optimizers[0].state
    assert state and {t.dtype for s in state.values() for k, t in s.items() if k != "step"} == {torch.float32}
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_losses), rtol=2e-2, atol=2e-2)

    exported = torch.load(tmp_path / "merged" / "model.pt", weights_only=True)
    assert {v.dtype for v in exported.values() if v.is_floating_point()} == {torch.float32}
    assert not any(v.dtype == torch.int8 for v in exported.values())
    scales = int8_scales(module)
    modules = dict(module.named_modules())
    wte = module.model.wte.weight
    torch.testing.assert_close(exported["model.wte.weight"], dequantized(wte, scales[id(wte)], torch.float32),
                               rtol=0, atol=0)
    for layer in ("model.blocks.0.attn.qkv", "model.blocks.1.mlp.proj"):
        lora = modules[layer]
        w = lora.base_layer.weight
        by_hand = dequantized(w, scales[id(w)], torch.float32) + (
            lora.lora_B["default"].weight @ lora.lora_A["default"].weight) * lora.scaling["default"]
        torch.testing.assert_close(exported[f"{layer}.weight"], by_hand.detach(), rtol=1e-6, atol=1e-7)
    assert module.model.wte.weight.dtype == torch.int8  # the export left the trained module as it was


def test_the_fit_check_counts_one_byte_per_frozen_weight_and_names_int8_after_bf16(make_cfg, tmp_path):
    pytest.importorskip("transformers")
    from lit_speed.run.memory_fit import fit_check, fit_levers
    from tests.helpers.tiny_hf import save_tiny_causal_lm, write_texts

    folder = save_tiny_causal_lm(tmp_path / "tiny_qwen2", "qwen2", seed=0)
    (tmp_path / "texts").mkdir()
    texts = write_texts(tmp_path / "texts")
    cfg = make_cfg(["model=hf_causal_lm", "data=text_folder", f"model.pretrained={folder}", f"data.root={texts}",
                    "data.block_size=32", "data.batch_size=4", "trainer.max_steps=2", "logger=none", "callbacks=none",
                    "validate=false", "peft=lora", "peft.base_dtype=int8"])
    configured = fit_levers.configured_levers(cfg)
    assert configured.base_int8 and not configured.base_bf16
    int8 = fit_check.estimate_run(cfg, configured, process_bytes=0)
    bf16 = fit_check.estimate_run(cfg, replace(configured, base_int8=False, base_bf16=True), process_bytes=0)
    facts = fit_check.run_facts(cfg, folder, configured)
    assert bf16.weights - int8.weights == facts.frozen  # 2 -> 1 byte per frozen parameter
    sets = fit_levers.lever_sets(replace(configured, base_int8=False), False)
    names = [s.overrides(replace(configured, base_int8=False), []) for s in sets]
    assert any("peft.base_dtype=int8" in n for n in names)
    assert all(not (s.base_int8 and s.base_bf16) for s in sets)


def test_int8_and_bf16_are_the_base_dtypes_a_bad_one_is_refused_naming_them():
    with pytest.raises(ValueError, match=r"PEFTAdapters\(base_dtype='int4'\): the frozen base is held in one of bf16, "
                                         r"int8 or as loaded"):
        PEFTAdapters(base_dtype="int4")
    model = _lora_gpt()
    with pytest.raises(ValueError, match=r"lower_frozen_base\(dtype=torch.float16\): one of torch.bfloat16, "
                                         r"torch.int8"):
        lower_frozen_base(model, torch.float16)


def test_the_chunked_loss_over_an_int8_tied_head_equals_the_unchunked_loss(tmp_path):
    # Qwen2 ties its LM head to the embedding: the chunked loss reads head.weight itself, so it must dequantize it
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from lit_speed.finetune.adapters import add_adapters
    from lit_speed.memory.chunked_lm_loss import chunked_lm_loss
    from lit_speed.memory.hf_chunked_loss import chunk_hf_loss
    from tests.helpers.tiny_hf import save_tiny_causal_lm

    folder = save_tiny_causal_lm(tmp_path / "tiny_qwen2", "qwen2", seed=0, tokenizer=False)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(folder)
    add_adapters(hf, "lora", ["all-linear"], r=4, options={"init_lora_weights": False})
    lower_frozen_base(hf, torch.int8)
    head = hf.get_output_embeddings()
    assert head.weight.dtype == torch.int8 and head.held_weight_scale is hf.get_input_embeddings().held_weight_scale
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    trainable = [p for p in hf.parameters() if p.requires_grad]
    plain = hf(input_ids=ids, labels=ids).loss
    plain_grads = torch.autograd.grad(plain, trainable)
    chunk_hf_loss(hf, chunk_bytes=4096)
    chunked = hf(input_ids=ids, labels=ids).loss
    chunked_grads = torch.autograd.grad(chunked, trainable)
    torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=1e-5)
    for a, b in zip(chunked_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match=r"an int8 head weight needs its weight_scale"):
        chunked_lm_loss(torch.randn(3, head.weight.shape[1]), head.weight, torch.zeros(3, dtype=torch.long))


def test_the_models_own_chunked_loss_over_an_int8_head_equals_their_plain_loss(tmp_path):
    # GPT (tied wte/lm_head) and HFCausalLM hand the head's weight to chunked_lm_loss themselves (use_chunked_loss)
    from lit_speed.models.hf_causal_lm import HFCausalLM
    from tests.helpers.tiny_hf import save_tiny_causal_lm

    gpt = _lora_gpt()
    lower_frozen_base(gpt, torch.int8)
    folder = save_tiny_causal_lm(tmp_path / "tiny_qwen2", "qwen2", seed=0, tokenizer=False)
    hf = HFCausalLM(str(folder))
    PEFTAdapters(r=4, base_dtype="int8", export=False, options={"init_lora_weights": False}).prepare_model(hf)
    for model, vocab in ((gpt, 97), (hf, 300)):
        x = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(2))
        batch = (x, torch.roll(x, -1, 1))
        plain = model.batch_loss(batch)
        model.use_chunked_loss(4096)
        chunked = model.batch_loss(batch)
        model.use_chunked_loss(None)
        torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=1e-5)
