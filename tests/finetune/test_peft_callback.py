"""PEFTAdapters: adapters by names or classes on the bundled GPT, a Hugging Face model and a foreign LightningModule;
the base stays frozen, only adapters reach the optimizer, checkpoints hold the adapters, the merged export loads into
a plain model and gives the same outputs, and bad targets are refused with the names that exist."""
from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lit_speed.finetune.adapters import add_adapters, module_names_matching
from lit_speed.finetune.export import export_merged
from lit_speed.finetune.peft_callback import PEFTAdapters
from lit_speed.memory.model_state import parameter_counts
from lit_speed.models.gpt import GPTModule
from lit_speed.run.config_error import ConfigError
from lit_speed.run.runner import train

SIZES = {"vocab_size": 97, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}
# a tiny charlm GPT run through the Hydra entry (in process): 12 optimizer steps, a checkpoint at the end
GPT_RUN = ["experiment=charlm_cpu", "model.n_layer=2", "model.n_embd=32", "model.n_head=2", "data.block_size=16",
           "data.max_bytes=100000", "trainer.max_steps=12", "trainer.val_check_interval=6", "trainer.limit_val_batches=1",
           "callbacks=[model_checkpoint]", "logger=none", "validate=false", "trainer.enable_progress_bar=false",
           "trainer.enable_model_summary=false", "trainer.num_sanity_val_steps=0"]


def _gpt(seed: int = 0) -> GPTModule:
    torch.manual_seed(seed)
    return GPTModule(**SIZES)


def test_lora_by_names_freezes_the_base_and_counts_rank_times_width():
    model = _gpt()
    total_before = parameter_counts(model).total
    targets = add_adapters(model, "lora", ["qkv", "fc"], r=4)
    assert targets == ["model.blocks.0.attn.qkv", "model.blocks.0.mlp.fc", "model.blocks.1.attn.qkv",
                       "model.blocks.1.mlp.fc"]
    trainable, total = parameter_counts(model).trainable, parameter_counts(model).total
    # r * (d_in + d_out) per layer: qkv 32 -> 96, fc 32 -> 128
    assert trainable == 2 * 4 * ((32 + 96) + (32 + 128))
    assert total == total_before + trainable
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)


def test_targets_by_class_and_all_linear_leave_out_the_tied_head():
    by_class = module_names_matching(_gpt(), ["Linear"])
    all_linear = module_names_matching(_gpt(), ["all-linear"])
    assert "model.lm_head" in by_class and "model.lm_head" not in all_linear
    assert len(all_linear) == len(by_class) - 1 == 8  # qkv, proj, fc, proj per block
    assert module_names_matching(_gpt(), ["last-linear"]) == ["model.lm_head"]
    # one name as a string (peft's own spelling; a command line's peft.target_modules=all-linear), not its letters
    assert add_adapters(_gpt(), "lora", "all-linear") == all_linear
    assert add_adapters(_gpt(), "freeze", (), trainable_modules="last-linear") == []


def test_a_target_that_matches_nothing_is_refused_listing_what_exists():
    with pytest.raises(ValueError, match=r"PEFTAdapters\(target_modules=\['qvk'\]\): 'qvk' matches no module name or "
                                         r"class of GPTModule\. Module names: attn, blocks, drop, dropout, fc, lm_head, "
                                         r"ln_1, ln_2, ln_f, mlp, model, proj, qkv, .*Classes: .*Block.*Linear.*Fix: "):
        add_adapters(_gpt(), "lora", ["qvk"])
    with pytest.raises(ValueError, match=r"PEFTAdapters\(r=0\): the adapter rank must be an int >= 1"):
        PEFTAdapters(r=0)
    with pytest.raises(ValueError, match=r"PEFTAdapters\(method='adapterz'\): unknown method\. Fix: method=<one of "
                                         r"lora, loha, lokr, freeze>"):
        PEFTAdapters(method="adapterz")
    with pytest.raises(ValueError, match=r"peft refused .*Fix: target layers"):  # a container, not a layer
        add_adapters(_gpt(), "lora", ["Block"])


def test_a_bad_target_through_the_runner_is_a_config_error_naming_the_setting(make_cfg):
    with pytest.raises(ConfigError, match=r"peft\.target_modules=\['qvk'\]: PEFTAdapters\(target_modules=\['qvk'\]\): "
                                          r"'qvk' matches no module name"):
        train(make_cfg([*GPT_RUN, "peft=lora", "peft.target_modules=[qvk]"]))


def _frozen(model: nn.Module) -> dict[str, torch.Tensor]:
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    # named as in a model without adapters (the merged export): peft keeps the base layer under .base_layer
    return {k.replace(".base_layer", ""): v.clone() for k, v in model.state_dict().items()
            if k not in trainable and "lora_" not in k}


@pytest.mark.parametrize("extra", [[], ["precision=bf16-master"], ["precision=bf16-mixed"],
                                   ["accumulation=fixed", "accumulation.factors=[[0,2]]"],
                                   ["callbacks=[model_checkpoint,activation_checkpointing]"]],
                         ids=["32-true", "bf16-master", "bf16-mixed", "accumulation", "activation_checkpointing"])
def test_lora_on_the_bundled_gpt_trains_adapters_only_and_checkpoints_them(make_cfg, tmp_path, extra):
    from lit_speed.run.runner import build

    cfg = make_cfg([*GPT_RUN, "peft=lora", "peft.r=4", *extra])
    base = _frozen(build(cfg)["model"])  # the seeded build: the same start train() makes
    summary = train(cfg)
    peft = summary["components"]["PEFTAdapters"]
    assert 0 < peft["trainable_params"] < peft["total_params"] / 4
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["adapters_only"] is True
    assert ckpt["state_dict"] and all("lora_" in k for k in ckpt["state_dict"])
    assert sum(v.numel() for v in ckpt["state_dict"].values()) == peft["trainable_params"]
    exported = torch.load(tmp_path / "merged" / "model.pt", map_location="cpu", weights_only=True)
    assert not any("lora_" in k for k in exported)
    changed = [k for k, v in base.items() if not torch.equal(exported[k], v)]
    # the merged layers changed by the adapters' update; the frozen rest (embeddings, norms) did not
    assert changed and all(k.endswith(("qkv.weight", "proj.weight", "fc.weight")) for k in changed), changed
    assert summary["global_step"] == 12 and summary["startup"]["trainable parameters"].startswith(
        f"{peft['trainable_params']:,} of {peft['total_params']:,}")


def test_merged_export_loads_into_a_plain_model_with_the_same_outputs(tmp_path):
    model = _gpt(1)
    add_adapters(model, "lora", ["all-linear"], r=4)
    with torch.no_grad():  # a non-zero update (LoRA's B starts at zero)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    x = torch.randint(0, 97, (3, 16))
    expected = model(x)
    paths = export_merged(model, tmp_path / "merged")
    plain = GPTModule(**SIZES)  # no peft, no lit_speed.finetune: torch's own load_state_dict
    plain.load_state_dict(torch.load(paths["state_dict"], weights_only=True), strict=True)
    torch.testing.assert_close(plain(x), expected, rtol=1e-5, atol=1e-5)  # merge sums in another order: float noise
    from peft.tuners.lora.layer import LoraLayer

    assert any(isinstance(m, LoraLayer) for m in model.modules())  # left as it was



def _with_random_lora(hf: nn.Module) -> nn.Module:
    """``hf`` inside a holder module, LoRA r=4 on all its Linear layers, up-projections random (a merge that moves)."""
    holder = nn.Module()
    holder.model = hf
    add_adapters(holder, "lora", ["all-linear"], r=4)
    with torch.no_grad():
        for name, p in holder.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    return holder


@pytest.mark.parametrize("tied", [True, False])
def test_hf_export_is_one_float32_folder_in_shards_that_loads_alone_and_leaves_the_model_as_it_was(tmp_path, tied):
    """The merged Hugging Face folder is written shard by shard (a shard limit far below the model forces several),
    loads with from_pretrained with no missing or unexpected tensor, gives the adapted model's logits, is float32,
    and the trained model keeps its adapters and every tensor bitwise."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from lit_speed.finetune.export import write_hf_folder

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied))
    holder = _with_random_lora(hf)
    before = {k: v.clone() for k, v in holder.state_dict().items()}
    x = torch.randint(0, 120, (2, 12))
    expected = hf(input_ids=x).logits
    folder = write_hf_folder(hf, tmp_path / "hf", max_shard_bytes=20_000)
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 2 and (folder / "model.safetensors.index.json").is_file()
    loaded, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert loaded.dtype == torch.float32 and loaded.config.tie_word_embeddings == tied
    torch.testing.assert_close(loaded(input_ids=x).logits, expected, rtol=1e-5, atol=1e-5)  # merge order: float noise
    after = holder.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert export_merged(holder, tmp_path / "auto").keys() == {"hf"}  # auto: one format for a Hugging Face model
    assert not (tmp_path / "auto" / "model.pt").exists()


@pytest.mark.parametrize("setting", ["auto", "float32"])
def test_hf_export_of_a_bf16_folder_is_bf16_rounded_once_from_the_float32_merge(tmp_path, setting):
    """``export_dtype=auto``: a model read in float32 from a folder that declares bf16 is written as a bf16 folder
    (config and every tensor), each value the float32 merge rounded to bf16 once; ``float32`` keeps the merge; a
    float32 folder stays float32 under auto."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from lit_speed.finetune.export import folder_dtype, merged_tensors

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    LlamaForCausalLM(config).save_pretrained(tmp_path / "fp32")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32)  # as lit_speed's loader reads it
    assert hf.dtype == torch.float32 and folder_dtype(hf) == torch.bfloat16
    holder = _with_random_lora(hf)
    merge = {k.removeprefix("model."): v for group in merged_tensors(holder) for k, v in group.items()}
    folder = tmp_path / "out" / "hf"
    assert export_merged(holder, tmp_path / "out", dtype=setting) == {"hf": str(folder)}
    written = load_file(folder / "model.safetensors")
    dtype = torch.bfloat16 if setting == "auto" else torch.float32
    assert written.keys() == merge.keys() and {v.dtype for v in written.values()} == {dtype}
    assert all(torch.equal(written[k], merge[k].to(dtype)) for k in merge)  # one rounding, to nearest even
    assert AutoModelForCausalLM.from_pretrained(folder).config.dtype == dtype
    changed = sum(int((merge[k].to(torch.bfloat16) != merge[k]).any()) for k in merge if "proj" in k)
    assert setting == "float32" or changed > 0  # the bf16 export really rounds: the float32 merge is off the grid
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.float32)
    assert folder_dtype(plain) == torch.float32
    export_merged(plain, tmp_path / "plain")  # auto, a float32 folder: float32
    assert {v.dtype for v in load_file(tmp_path / "plain" / "hf" / "model.safetensors").values()} == {torch.float32}


def test_state_dict_export_is_float32_under_auto_and_the_named_dtype_otherwise(tmp_path):
    model = _gpt()
    add_adapters(model, "lora", ["qkv"], r=4)
    from lit_speed.finetune.export import merged_tensors

    merged = {k: v for group in merged_tensors(model) for k, v in group.items()}
    for setting, dtype in (("auto", torch.float32), ("bfloat16", torch.bfloat16)):
        path = export_merged(model, tmp_path / setting, dtype=setting)["state_dict"]
        state = torch.load(path, weights_only=True)
        assert {v.dtype for v in state.values() if v.is_floating_point()} == {dtype}
        assert all(torch.equal(state[k], v.to(dtype)) for k, v in merged.items())


def test_export_dtype_unknown_is_refused_naming_the_setting_and_the_fix(tmp_path):
    from lit_speed.finetune.export_callback import ExportModel

    with pytest.raises(ValueError, match=r"PEFTAdapters\(export_dtype='fp8'\): must be one of auto, float32, "
                                         r"bfloat16, float16\. Fix: export_dtype=auto"):
        PEFTAdapters(export_dtype="fp8")
    with pytest.raises(ValueError, match=r"ExportModel\(export_dtype='half'\).*Fix: export_dtype=auto"):
        ExportModel(export_dtype="half")
    with pytest.raises(ValueError, match=r"export_merged\(export_dtype='bf16'\)"):
        export_merged(_gpt(), tmp_path, dtype="bf16")


def test_export_format_hf_without_a_hugging_face_model_is_refused_naming_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"export_format=state_dict"):
        export_merged(_gpt(), tmp_path, format="hf")
    with pytest.raises(ValueError, match=r"export_format='zip'.*auto, hf, state_dict"):
        PEFTAdapters(export_format="zip")

def test_loha_adapters_train_and_merge(tmp_path):
    model = _gpt(2)
    add_adapters(model, "loha", ["qkv"], r=2, alpha=2.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.01 * torch.randn_like(p))
    x = torch.randint(0, 97, (2, 16))
    plain = GPTModule(**SIZES)
    plain.load_state_dict(torch.load(export_merged(model, tmp_path)["state_dict"], weights_only=True))
    torch.testing.assert_close(plain(x), model(x), rtol=1e-5, atol=1e-5)


class Foreign(pl.LightningModule):
    """Someone else's module: its own layer names, and an optimizer over all of self.parameters()."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16))
        self.classifier = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encoder(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_lora_on_a_foreign_lightning_module_through_a_plain_trainer(tmp_path):
    torch.manual_seed(0)
    module = Foreign()
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
    peft = PEFTAdapters("lora", target_modules=["encoder.0", "encoder.2"], r=2, trainable_modules=["classifier"],
                        export_dir=str(tmp_path / "merged"))
    base = {k: v.clone() for k, v in module.state_dict().items() if k.startswith("encoder")}
    trainer = pl.Trainer(max_steps=6, callbacks=[peft], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=16))
    assert peft.dropped_from_optimizer == 4  # the encoder's frozen weights and biases never reach AdamW
    stepped = [p for group in trainer.optimizers[0].param_groups for p in group["params"]]
    assert all(p.requires_grad for p in stepped) and len(stepped) == 4 + 2  # 2 x (lora_A, lora_B) + classifier
    after = module.state_dict()
    assert all(torch.equal(after[k.replace("encoder.0.", "encoder.0.base_layer.").replace(
        "encoder.2.", "encoder.2.base_layer.")], v) for k, v in base.items())
    plain = Foreign()
    plain.load_state_dict(torch.load(tmp_path / "merged" / "model.pt", weights_only=True))
    x = torch.randn(5, 8)
    torch.testing.assert_close(plain(x), module(x), rtol=1e-5, atol=1e-5)


def test_resuming_onto_other_base_weights_is_refused(tmp_path):
    peft = PEFTAdapters("lora", ["qkv"], r=2)
    peft.prepare_model(_gpt(1))
    other = PEFTAdapters("lora", ["qkv"], r=2)
    other.prepare_model(_gpt(2))
    with pytest.raises(ValueError, match=r"trained on other base weights .*Fix: the init\.path / model\.pretrained"):
        other.load_state_dict(peft.state_dict())
    same = PEFTAdapters("lora", ["qkv"], r=2)
    same.prepare_model(_gpt(1))
    same.load_state_dict(peft.state_dict())


def test_an_adapters_only_checkpoint_of_other_targets_is_refused_on_load():
    peft = PEFTAdapters("lora", ["qkv", "fc"], r=2)
    peft.prepare_model(_gpt(1))
    written = {k: torch.zeros(1) for k in peft.trainable_names if ".fc." not in k}  # a run that adapted qkv only
    with pytest.raises(ValueError, match=r"the checkpoint lacks 4 of this run's 8 trainable tensors \(the first is "
                                         r"model\.blocks\.0\.mlp\.fc\.lora_A\.default\.weight\).*Fix: the peft\.method"):
        peft.on_load_checkpoint(None, None, {"adapters_only": True, "state_dict": written})
    peft.on_load_checkpoint(None, None, {"state_dict": written})  # a full checkpoint: Lightning's strict load decides
