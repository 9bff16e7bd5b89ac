"""The export's merge of a plain LoRA ``Linear`` (computed from the layer in place, without copying it) gives
bitwise the tensors of ``peft``'s own ``merge(safe_merge=True)`` on a float32 copy of the layer, for a float32,
bf16-held and int8-held base, GPT-2's transposed ``Conv1D``, bf16 adapters and rsLoRA's scaling; other layers
(DoRA) still go through ``peft``; a non-finite merge is refused either way; the model is left as it was."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lit_speed.finetune.adapters import adapter_layers, add_adapters
from lit_speed.finetune.export import merged_tensors
from lit_speed.finetune.frozen_base import dequantize_frozen_base, lower_frozen_base


def _by_peft(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every adapter layer merged by peft on a float32 copy of that layer (the export's general path)."""
    out = {}
    for name, layer in adapter_layers(module):
        one = copy.deepcopy(layer)
        dequantize_frozen_base(one)
        one = one.float()
        one.merge(safe_merge=True)
        out.update({f"{name}.{k}": v.float() for k, v in one.get_base_layer().state_dict().items()})
    return out


def _holder(arch: str, **lora) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if arch == "gpt2":  # Conv1D: weight [in, out], peft's fan_in_fan_out
        hf = GPT2LMHeadModel(GPT2Config(vocab_size=90, n_positions=16, n_embd=32, n_layer=2, n_head=4))
        targets = ["c_attn", "c_proj", "c_fc"]
    else:
        hf = LlamaForCausalLM(LlamaConfig(vocab_size=90, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2))
        targets = ["all-linear"]
    holder = nn.Module()
    holder.model = hf
    add_adapters(holder, "lora", targets, r=4, options=lora or None)
    with torch.no_grad():
        for name, p in holder.named_parameters():
            if "lora_B" in name or "lora_magnitude" in name:
                p.normal_(std=0.05)  # a non-zero update (B starts at zero)
    return holder


@pytest.mark.parametrize("arch,base,adapters,lora", [
    ("llama", None, torch.float32, {}),
    ("gpt2", None, torch.float32, {}),
    ("llama", torch.bfloat16, torch.float32, {}),
    ("llama", torch.int8, torch.float32, {}),
    ("gpt2", torch.int8, torch.float32, {}),
    ("llama", None, torch.bfloat16, {}),
    ("llama", None, torch.float32, {"use_rslora": True}),
])
def test_a_plain_lora_merge_in_place_is_bitwise_peft_merging_a_float32_copy(arch, base, adapters, lora, monkeypatch):
    holder = _holder(arch, **lora)
    if base is not None:
        lower_frozen_base(holder, base)
    for name, p in holder.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(adapters)
    before = {k: v.clone() for k, v in holder.state_dict().items()}
    expected = _by_peft(holder)
    monkeypatch.setattr(copy, "deepcopy", lambda *_: pytest.fail("a plain LoRA layer was copied to merge it"))
    got = {k: v for group in merged_tensors(holder) for k, v in group.items() if k in expected}
    assert got.keys() == expected.keys() and len(got) >= 8
    for key, value in expected.items():
        assert got[key].dtype == torch.float32 and torch.equal(got[key], value), key
    after = holder.state_dict()
    assert all(torch.equal(after[k], before[k]) and after[k].dtype == before[k].dtype for k in before)


def test_dora_layers_are_merged_by_peft_and_load_into_a_plain_model_with_the_adapted_outputs():
    from transformers import LlamaForCausalLM

    holder = _holder("llama", use_dora=True)
    assert all(layer.lora_variant for _, layer in adapter_layers(holder))
    x = torch.randint(0, 90, (2, 12))
    expected = holder.model(input_ids=x).logits
    merged = {k: v for group in merged_tensors(holder) for k, v in group.items()}
    by_peft = _by_peft(holder)
    assert all(torch.equal(merged[k], v) for k, v in by_peft.items())  # the general path: peft's merge itself
    plain = LlamaForCausalLM(holder.model.config)
    missing, unexpected = plain.load_state_dict({k.removeprefix("model."): v for k, v in merged.items()}, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    torch.testing.assert_close(plain(input_ids=x).logits, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(holder.model(input_ids=x).logits, expected, rtol=0, atol=0)  # left as it was


@pytest.mark.parametrize("dora", [False, True])
def test_a_non_finite_merge_is_refused_naming_the_adapter(dora):
    holder = _holder("llama", use_dora=dora)
    name, layer = adapter_layers(holder)[3]
    with torch.no_grad():
        layer.lora_B["default"].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaNs detected in the merged weights. The adapter default"):
        for _ in merged_tensors(holder):
            pass


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("shard_share", [0.05, 0.3, 2.0])
@pytest.mark.parametrize(("held", "written"), [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.int8, torch.bfloat16)])
def test_the_export_peak_walked_from_shapes_bounds_what_writing_the_folder_holds(tmp_path, arch, shard_share, held,
                                                                                 written):
    # the planner's export term (scripts/plan.py, the fit check): walked on a meta-device copy, against the tensors
    # write_hf_folder allocates at once with a bf16- or int8-held base, written in float32 (every merged tensor a
    # float32 copy: the walk's own case) or in bf16 (a bf16-held tensor is written as it is, an int8-held one is
    # dequantized to float32 and then cast: the walk counts both)
    from lit_speed.finetune.export import export_peak_bytes, write_hf_folder
    from lit_speed.memory.memory_tracker import LiveTensorTracker

    holder = _holder(arch)
    lower_frozen_base(holder, held)
    whole = 4 * sum(p.numel() for p in holder.model.parameters())
    shard = int(whole * shard_share)
    with torch.device("meta"):
        on_meta = _holder(arch)
        lower_frozen_base(on_meta, held) if held == torch.int8 else None  # int8 changes the shapes' dtypes
    predicted = export_peak_bytes(on_meta.model, shard)
    assert predicted == export_peak_bytes(holder.model, shard)
    with LiveTensorTracker() as tracker:
        write_hf_folder(holder.model, tmp_path / "hf", max_shard_bytes=shard, dtype=written)
    # the float32 norms and biases are written as they are (no copy): the walk counts them, a few percent
    low = 0.9 if written == torch.float32 else 0.3
    assert low * predicted <= tracker.peak_bytes <= predicted
