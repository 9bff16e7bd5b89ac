"""CompileModel: in-place compile, so compiled and uncompiled checkpoints load into each other."""
from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lit_speed.memory.compile_model import CompileModel, compile_modules, is_compiled, uncompile_modules
from lit_speed.models.gpt import GPT, GPTModule
from tests.helpers.memory import adamw, charlm_datamodule

SMALL = {"vocab_size": 97, "block_size": 64, "n_layer": 2, "n_head": 2, "n_embd": 32}


def test_in_place_compile_keeps_state_dict_keys():
    model = GPT(**SMALL)
    keys = list(model.state_dict())
    assert compile_modules(model, regional=True, backend="eager") == ["blocks.0", "blocks.1"]
    assert list(model.state_dict()) == keys and not any("_orig_mod" in k for k in model.state_dict())
    # torch 2.13 internal used by uncompile_modules: nn.Module.compile() sets `_compiled_call_impl`
    assert all(m._compiled_call_impl is not None for m in model.blocks)
    assert uncompile_modules(model) == 2 and not any(is_compiled(m) for m in model.modules())
    assert compile_modules(model, regional=False, backend="eager") == [""] and is_compiled(model)


def test_repeated_block_types_skips_leaf_layers():
    from lit_speed.memory.compile_model import repeated_block_types
    from lit_speed.models.mlp import MLPClassifier

    assert [c.__name__ for c in repeated_block_types(GPT(**SMALL))] == ["Block"]
    assert repeated_block_types(MLPClassifier()) == []  # Sequential of Linear/GELU/Dropout: nothing worth wrapping


def test_errors():
    with pytest.raises(ValueError, match=r"CompileModel\(mode='fast'\): mode must be one of .*got 'fast'"):
        CompileModel(mode="fast")
    with pytest.raises(ValueError, match="has no repeated block type; name one with modules="):
        compile_modules(torch.nn.Linear(2, 2), regional=True)


def _fit(tmp_path, callbacks, model):
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, limit_val_batches=0, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks, default_root_dir=tmp_path)
    trainer.fit(model, datamodule=charlm_datamodule(4))
    path = tmp_path / f"{len(callbacks)}.ckpt"
    trainer.save_checkpoint(path)
    return torch.load(path, weights_only=False)["state_dict"]


# eager only traces with dynamo (seconds); inductor generates kernels (a 30-50 s cold compile on this CPU)
@pytest.mark.parametrize("backend, atol", [("eager", 0.0), pytest.param("inductor", 1e-5, marks=pytest.mark.slow)])
def test_checkpoints_load_both_ways_with_identical_outputs(tmp_path, backend, atol):
    # atol for inductor: fused kernels reorder float32 sums, so outputs agree to rounding, not bit for bit
    x = torch.randint(0, 97, (3, 64))
    torch.manual_seed(0)
    compiled_run = GPTModule(**SMALL, optimizer=adamw)
    callback = CompileModel(backend=backend)
    state = _fit(tmp_path, [callback], compiled_run)
    assert callback.compiled == ["model.blocks.0", "model.blocks.1"]
    assert not any("_orig_mod" in k for k in state)

    # compiled run -> uncompiled model
    plain = GPTModule(**SMALL)
    plain.load_state_dict(state, strict=True)
    compile_modules(compiled_run, backend=backend)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), compiled_run(x), rtol=0, atol=atol)

    # uncompiled run -> compiled model
    torch.manual_seed(1)
    eager_run = GPTModule(**SMALL, optimizer=adamw)
    eager_state = _fit(tmp_path, [], eager_run)
    target = GPTModule(**SMALL)
    target.load_state_dict(eager_state, strict=True)
    compile_modules(target, backend=backend)
    with torch.no_grad():
        torch.testing.assert_close(target(x), eager_run(x), rtol=0, atol=atol)


def test_compile_yaml_keys_match_the_constructor():
    import hydra

    from lit_speed.run.config_check import preflight

    cfg = preflight(["callbacks=[default,compile]", "callbacks.compile.regional=false"])
    callback = hydra.utils.instantiate(cfg.callbacks.compile)
    assert isinstance(callback, CompileModel) and callback.regional is False and callback.backend == "inductor"
