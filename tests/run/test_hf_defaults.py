"""A Hugging Face model's run gets the speed levers without flags: its loss in chunks (``conf/model/hf_causal_lm.yaml``'s
``loss_chunk_mib``) and freed memory kept for the next step (``KeepFreedMemory``, added by ``scripts/train.py`` unless
the config says where freed memory goes)."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from lit_speed.memory.allocator import KeepFreedMemory, ReturnFreedMemory  # noqa: E402
from lit_speed.run.runner import build  # noqa: E402
from tests.helpers.tiny_hf import save_tiny_causal_lm, write_texts  # noqa: E402


@pytest.fixture(scope="module")
def args(tmp_path_factory):
    folder = save_tiny_causal_lm(tmp_path_factory.mktemp("hf") / "tiny_qwen2", "qwen2", seed=0)
    texts = write_texts(tmp_path_factory.mktemp("texts"))
    return ["model=hf_causal_lm", "data=text_folder", f"model.pretrained={folder}", f"data.root={texts}",
            "data.block_size=32", "data.batch_size=4", "data.val_every=3", "trainer.max_steps=2", "logger=none",
            "validate=false", "trainer.enable_progress_bar=false"]


@pytest.fixture(autouse=True)
def pins(monkeypatch):
    """Calls of ``return_freed_memory``, recorded instead of made: pinned, the threshold would stay so for the rest of
    the test process (``build`` pins it before the weights load)."""
    from lit_speed.memory import allocator

    calls = []
    monkeypatch.setattr(allocator, "return_freed_memory", lambda *a, **k: calls.append("pinned") or True)
    return calls


def _allocator_callbacks(parts: dict) -> list:
    return [cb for cb in parts["callbacks"] if isinstance(cb, (KeepFreedMemory, ReturnFreedMemory))]


def test_a_hugging_face_run_chunks_its_loss_and_keeps_freed_memory_by_default(make_cfg, args):
    parts = build(make_cfg(args))
    assert parts["model"].loss_chunk_bytes == 128 * 2**20
    (keep,) = _allocator_callbacks(parts)
    assert isinstance(keep, KeepFreedMemory) and keep.by_default
    assert "the default for a Hugging Face model; callbacks=[default,return_freed_memory] returns it" in \
        keep.describe()["freed memory"]


@pytest.mark.parametrize("extra, kind", [(["callbacks=[default,return_freed_memory]"], ReturnFreedMemory),
                                         (["callbacks=[default,keep_freed_memory]"], KeepFreedMemory)])
def test_a_configured_allocator_callback_is_the_only_one(make_cfg, args, extra, kind):
    (only,) = _allocator_callbacks(build(make_cfg(args + extra)))
    assert type(only) is kind and not getattr(only, "by_default", False)


def test_the_plain_loss_and_a_run_of_another_model_get_neither_default(make_cfg, args):
    assert build(make_cfg(args + ["model.loss_chunk_mib=null"]))["model"].loss_chunk_bytes is None
    assert not _allocator_callbacks(build(make_cfg(["trainer.max_steps=1", "logger=none"])))


def test_return_freed_memory_is_in_force_before_the_weights_load(make_cfg, args, monkeypatch, pins):
    # what loading and lowering the base free goes back too (the callback's setup comes after both)
    import transformers

    load = transformers.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pins.append("loaded") or load(*a, **k))
    (only,) = _allocator_callbacks(build(make_cfg(args + ["callbacks=[default,return_freed_memory]"])))
    assert pins == ["pinned", "loaded"] and only.applied
