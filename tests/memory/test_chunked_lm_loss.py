"""The LM head and cross-entropy in chunks: the loss and every gradient equal the plain ones (fp32 to float tolerance,
bf16 autocast within its rounding), for the functional core, Hugging Face causal LMs of several head kinds (untied,
tied, biased, projected, scaled, soft-capped) and the bundled GPT; the logits never exist whole (tracked tensor
bytes); models whose logits are more than their head are refused."""
from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from lit_speed import ChunkedLMLoss, chunk_hf_loss, chunked_lm_loss, chunked_loss_bytes, hf_lm_head, unchunk_hf_loss
from lit_speed.memory.memory_tracker import LiveTensorTracker
from lit_speed.models.gpt import GPTModule

# float32: chunking only re-associates sums (the loss over chunks, the head's gradient over chunks, the softmax's
# normaliser): ~1e-7 of the largest value; an element near zero is compared against the tensor's scale
FP32 = {"rtol": 1e-5, "atol": 1e-6}
V = 97


def _close(got: torch.Tensor, expected: torch.Tensor, **kw) -> None:
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6 * max(1.0, float(expected.abs().max())), **kw)


def _plain(hidden, weight, targets, bias=None, scale=1.0, softcap=None, reduction="mean"):
    logits = (hidden @ weight.t() + (0 if bias is None else bias)).float() * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=-100, reduction=reduction)


def _inputs(seed=0, n=37, h=16, bias=False):
    torch.manual_seed(seed)
    hidden = torch.randn(2, n, h, requires_grad=True)
    weight = torch.randn(V, h, requires_grad=True)
    b = torch.randn(V, requires_grad=True) if bias else None
    targets = torch.randint(0, V, (2, n))
    targets[0, :5] = -100  # padding / prompt tokens: count neither in the loss nor in the mean
    return hidden, weight, b, targets


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("scale", "softcap"), [(1.0, None), (0.5, None), (1.0, 3.0)])
@pytest.mark.parametrize("grads_in_forward", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_loss_and_gradients_equal_the_plain_cross_entropy(bias, scale, softcap, grads_in_forward, reduction):
    hidden, weight, b, targets = _inputs(bias=bias)
    params = [hidden, weight] + ([b] if bias else [])
    plain = _plain(hidden, weight, targets, b, scale, softcap, reduction)
    expected = torch.autograd.grad(plain * 3.0, params)  # an incoming gradient other than 1 is scaled through
    chunked = chunked_lm_loss(hidden, weight, targets, b, chunk_bytes=V * 4 * 7, logit_scale=scale, softcap=softcap,
                              reduction=reduction, grads_in_forward=grads_in_forward)  # 7 tokens a chunk (5 chunks)
    got = torch.autograd.grad(chunked * 3.0, params)
    torch.testing.assert_close(chunked, plain, **FP32)
    for g, e in zip(got, expected):
        _close(g, e)


def test_num_items_in_batch_divides_the_sum_as_hugging_face_does():
    hidden, weight, _, targets = _inputs()
    summed = _plain(hidden, weight, targets, reduction="sum")
    torch.testing.assert_close(chunked_lm_loss(hidden, weight, targets, num_items_in_batch=100), summed / 100, **FP32)
    torch.testing.assert_close(chunked_lm_loss(hidden, weight, targets, num_items_in_batch=torch.tensor(100)),
                               summed / 100, **FP32)


def test_a_mean_over_no_token_is_nan_as_cross_entropy_and_no_grad_builds_no_graph():
    hidden, weight, _, targets = _inputs()
    assert torch.isnan(chunked_lm_loss(hidden, weight, torch.full_like(targets, -100)))
    with torch.no_grad():
        loss = chunked_lm_loss(hidden, weight, targets)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, _plain(hidden, weight, targets).detach(), **FP32)


def test_a_frozen_head_gets_no_gradient_and_a_bf16_frozen_head_is_cast_slice_by_slice():
    hidden, weight, _, targets = _inputs()
    frozen = weight.detach().to(torch.bfloat16)  # a low-precision frozen base's head
    loss = chunked_lm_loss(hidden, frozen, targets)
    (grad,) = torch.autograd.grad(loss, [hidden])
    plain = _plain(hidden, frozen.float(), targets)  # the same bf16 values, computed in float32
    torch.testing.assert_close(loss, plain, **FP32)
    torch.testing.assert_close(grad, torch.autograd.grad(plain, [hidden])[0], **FP32)


def test_under_bf16_autocast_the_matmuls_run_in_bf16_and_the_loss_in_float32():
    hidden, weight, b, targets = _inputs(bias=True, h=64)
    params = [hidden, weight, b]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = _plain(hidden, weight, targets, b)
        expected = torch.autograd.grad(plain, params)
        chunked = chunked_lm_loss(hidden, weight, targets, b, chunk_bytes=V * 6 * 7)
        got = torch.autograd.grad(chunked, params)
    assert chunked.dtype == torch.float32
    # both round the same bf16 matmul inputs; they differ only where bf16 partial sums are accumulated (the plain
    # path rounds the head's whole gradient to bf16 once, the chunked one adds bf16 chunks in float32): ~2^-8
    torch.testing.assert_close(chunked, plain, rtol=1e-3, atol=1e-3)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=2e-2, atol=2e-3 * float(e.abs().max()))


def test_a_bf16_head_under_bf16_autocast_gives_the_same_loss_in_many_chunks_as_in_one():
    """The reused chunk buffers (the bf16 matmul output, then the gradient's cast, in one buffer): each chunk's rows
    are computed as they would be alone."""
    hidden, weight, _, targets = _inputs(n=64, h=32)
    frozen = weight.detach().to(torch.bfloat16)
    results = []
    for chunk_bytes in (V * 6 * 5, V * 6 * 64):  # 13 chunks of 5 tokens (the last 4), or one of 64
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = chunked_lm_loss(hidden, frozen, targets, chunk_bytes=chunk_bytes)
            results.append((loss, *torch.autograd.grad(loss, [hidden])))
    torch.testing.assert_close(results[0][0], results[1][0], **FP32)
    torch.testing.assert_close(results[0][1], results[1][1], **FP32)


def test_the_logits_never_exist_whole_and_the_declared_cost_bounds_what_is_allocated():
    torch.manual_seed(0)
    tokens, vocab, width = 512, 8192, 32
    logits_bytes = tokens * vocab * 4  # 16 MiB
    hidden = torch.randn(tokens, width, requires_grad=True)
    weight = torch.randn(vocab, width, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    peaks = {}
    for name, run in {"plain": lambda: _plain(hidden, weight, targets),
                      "chunked": lambda: chunked_lm_loss(hidden, weight, targets, chunk_bytes=2**20)}.items():
        with LiveTensorTracker() as tracker:
            run().backward()
        peaks[name] = tracker.peak_bytes
    assert peaks["plain"] >= 2 * logits_bytes  # logits, log-softmax / their gradient
    assert peaks["chunked"] < logits_bytes / 4
    # what a planner is told: chunk buffers + grad_hidden + the trainable head's gradient
    declared = chunked_loss_bytes(tokens, vocab, width, chunk_bytes=2**20, weight_trains=True)
    assert peaks["chunked"] <= declared
    assert chunked_loss_bytes(tokens, vocab, width, chunk_bytes=2**20) < logits_bytes / 8


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32-compute", "bf16-autocast"])
def test_a_head_cast_slice_by_slice_stays_within_the_declared_cost_in_many_chunks(autocast):
    """A head whose dtype is not the compute dtype (a bf16-held frozen head computed in float32, or a float32 head
    under bf16 autocast) writes its vocabulary-major output into the chunk's own buffer, not beside it."""
    torch.manual_seed(0)
    tokens, vocab, width = 512, 8192, 32
    hidden = torch.randn(tokens, width, requires_grad=True)
    weight = torch.randn(vocab, width)
    weight = weight.requires_grad_() if autocast else weight.to(torch.bfloat16)
    targets = torch.randint(0, vocab, (tokens,))
    compute = torch.bfloat16 if autocast else torch.float32
    with LiveTensorTracker() as tracker, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        chunked_lm_loss(hidden, weight, targets, chunk_bytes=2**20).backward()
    declared = chunked_loss_bytes(tokens, vocab, width, chunk_bytes=2**20, compute=compute, weight_trains=autocast,
                                  weight_dtype=weight.dtype)
    assert tracker.peak_bytes <= declared, (tracker.peak_bytes, declared)


def test_bad_arguments_are_refused_naming_them():
    hidden, weight, _, targets = _inputs()
    with pytest.raises(ValueError, match=r"chunked_lm_loss\(reduction='none'\): one of mean, sum"):
        chunked_lm_loss(hidden, weight, targets, reduction="none")
    with pytest.raises(ValueError, match=r"chunked_lm_loss\(chunk_bytes=0\): a positive number of bytes"):
        chunked_lm_loss(hidden, weight, targets, chunk_bytes=0)
    with pytest.raises(ValueError, match=r"do not fit: hidden \[\.\.\., H\]"):
        chunked_lm_loss(hidden, weight.t(), targets)
    with pytest.raises(ValueError, match=r"ChunkedLMLoss\(chunk_mib=0\): .*Fix: chunk_mib=auto"):
        ChunkedLMLoss(chunk_mib=0)


# ---- Hugging Face causal LMs ------------------------------------------------------------------------------------

def _hf(name: str):
    import transformers as T

    common = {"vocab_size": V, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4}
    torch.manual_seed(0)
    if name in ("llama", "llama_tied"):
        return T.LlamaForCausalLM(T.LlamaConfig(**common, num_key_value_heads=2, tie_word_embeddings=name != "llama"))
    if name == "qwen2":  # Qwen2.5-0.5B's layout: tied embeddings
        return T.Qwen2ForCausalLM(T.Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=True))
    if name == "gpt2":  # tied, Conv1D layers
        return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                              bos_token_id=0, eos_token_id=0))
    if name == "phi":  # a biased head
        return T.PhiForCausalLM(T.PhiConfig(**common))
    if name == "opt":  # the decoder projects 32 -> 16 before a 16-wide head
        return T.OPTForCausalLM(T.OPTConfig(vocab_size=V, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                            num_attention_heads=4, word_embed_proj_dim=16, max_position_embeddings=64))
    if name == "gemma2":  # final_logit_softcapping
        return T.Gemma2ForCausalLM(T.Gemma2Config(**common, num_key_value_heads=2, head_dim=8,
                                                  final_logit_softcapping=3.0))
    if name == "cohere":  # logits * logit_scale
        return T.CohereForCausalLM(T.CohereConfig(**common, num_key_value_heads=2, logit_scale=0.5, eos_token_id=0))
    raise ValueError(name)


HF_MODELS = ["llama", "llama_tied", "qwen2", "gpt2", "phi", "opt", "gemma2", "cohere"]


def _batch(seed=1):
    torch.manual_seed(seed)
    ids = torch.randint(0, V, (2, 12))
    labels = ids.clone()
    labels[0, :4] = -100
    return ids, labels


@pytest.mark.parametrize("name", HF_MODELS)
def test_a_wrapped_hf_model_returns_its_own_loss_and_gradients_full_fine_tuning(name):
    model = _hf(name).eval()  # eval: no dropout, so both calls see the same function
    ids, labels = _batch()
    params = list(model.parameters())  # every weight trains, the tied embedding/head included
    own = model(input_ids=ids, labels=labels)
    expected = torch.autograd.grad(own.loss, params, allow_unused=True)
    assert chunk_hf_loss(model, chunk_bytes=V * 4 * 5)  # 5 tokens a chunk
    ours = model(ids, labels=labels)  # positional input_ids, as users call it
    got = torch.autograd.grad(ours.loss, params, allow_unused=True)
    assert ours.logits is None
    torch.testing.assert_close(ours.loss, own.loss, **FP32)
    for g, e in zip(got, expected):
        if e is not None:
            _close(g, e)
    assert model(input_ids=ids).logits.shape == (2, 12, V)  # without labels: the model's own forward
    assert unchunk_hf_loss(model) and "forward" not in vars(model)


def test_hf_loss_arguments_keep_their_meaning_and_outputs_their_form():
    model = _hf("llama").eval()
    ids, labels = _batch()
    shifted = labels[:, 1:].contiguous()
    expected = {"n": model(input_ids=ids, labels=labels, num_items_in_batch=50).loss,
                "shift": model(input_ids=ids[:, :-1], labels=labels[:, :-1], shift_labels=shifted).loss}
    chunk_hf_loss(model)
    torch.testing.assert_close(model(input_ids=ids, labels=labels, num_items_in_batch=50).loss, expected["n"], **FP32)
    torch.testing.assert_close(model(input_ids=ids[:, :-1], labels=labels[:, :-1], shift_labels=shifted).loss,
                               expected["shift"], **FP32)
    as_tuple = model(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(as_tuple, tuple) and as_tuple[0].ndim == 0
    assert len(model(input_ids=ids, labels=labels, output_hidden_states=True).hidden_states) == 3


def test_lora_gradients_equal_with_the_frozen_head():
    import peft

    model = _hf("qwen2").eval()
    peft.inject_adapter_in_model(peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
                                 model)
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    ids, labels = _batch()
    lora = [p for p in model.parameters() if p.requires_grad]
    expected = torch.autograd.grad(model(input_ids=ids, labels=labels).loss, lora)
    chunk_hf_loss(model, chunk_bytes=V * 4 * 5)
    for g, e in zip(torch.autograd.grad(model(input_ids=ids, labels=labels).loss, lora), expected):
        _close(g, e)


def test_a_model_whose_logits_are_more_than_its_head_is_refused():
    model = _hf("llama")
    model.config.logit_scale = 2.0  # the config declares a scale this model's forward does not apply
    with pytest.raises(ValueError, match=r"LlamaForCausalLM's logits are not its head applied to its decoder's output "
                                         r"\(scale 2, soft-cap None\): they differ by .* Fix: leave the loss unchunked"):
        hf_lm_head(model)
    model.config.logit_scale = None
    model.config.output_router_logits = True
    with pytest.raises(ValueError, match=r"adds its router's auxiliary loss .*Fix: config\.output_router_logits=false"):
        hf_lm_head(model)


# ---- the bundled models and the callback ------------------------------------------------------------------------

GPT_SIZES = {"vocab_size": V, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}


def test_gpt_module_chunked_loss_equals_its_plain_loss_with_the_tied_embedding_training():
    torch.manual_seed(0)
    plain, chunked = GPTModule(**GPT_SIZES), GPTModule(**GPT_SIZES, loss_chunk_mib=V * 4 * 5 / 2**20)
    chunked.load_state_dict(plain.state_dict())
    x = torch.randint(0, V, (3, 16))
    y = torch.roll(x, -1, 1)
    y[:, -1] = -100
    expected = torch.autograd.grad(plain.batch_loss((x, y)), list(plain.parameters()))
    got = torch.autograd.grad(chunked.batch_loss((x, y)), list(chunked.parameters()))
    assert chunked.model.lm_head.weight is chunked.model.wte.weight  # the head's gradient reaches the embedding
    for g, e in zip(got, expected):
        _close(g, e)


class OwnHFModule(pl.LightningModule):
    """A user's LightningModule that calls a Hugging Face model with labels, as the transformers docs show."""

    def __init__(self):
        super().__init__()
        self.lm = _hf("llama_tied").train()

    def training_step(self, batch, batch_idx):
        return self.lm(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _fit(module, callbacks, tmp_path):
    ids = torch.randint(0, V, (8, 12), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)
    trainer = pl.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         default_root_dir=tmp_path)
    trainer.fit(module, loader)
    return module


def test_the_callback_makes_a_users_hf_module_train_like_the_plain_one(tmp_path):
    torch.manual_seed(0)
    plain = OwnHFModule()
    chunked = OwnHFModule()
    chunked.load_state_dict(plain.state_dict())
    callback = ChunkedLMLoss(chunk_mib=0.002)
    _fit(plain, [], tmp_path)
    _fit(chunked, [callback], tmp_path)
    assert callback.final_summary()["modules"] == ["lm"]
    for (name, a), b in zip(plain.state_dict().items(), chunked.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=name)  # 4 SGD steps of float32 re-association
    assert "forward" not in vars(chunked.lm)  # undone at teardown


def test_the_callback_refuses_a_module_without_a_language_model_loss(tmp_path):
    from lit_speed.models.mlp import MLPClassifier

    with pytest.raises(ValueError, match=r"ChunkedLMLoss: MLPClassifier holds no Hugging Face causal LM and has no "
                                         r"use_chunked_loss\(chunk_bytes\) method .*Fix: drop chunked_loss"):
        ChunkedLMLoss().setup(pl.Trainer(logger=False), MLPClassifier(), "fit")


def test_hf_causal_lm_chunked_loss_equals_its_plain_loss_also_with_adapters(tmp_path):
    from lit_speed import HFCausalLM
    from lit_speed.finetune.adapters import add_adapters
    from tests.helpers.tiny_hf import save_tiny_causal_lm

    folder = save_tiny_causal_lm(tmp_path / "hf", hidden=32)
    plain, chunked = HFCausalLM(str(folder)), HFCausalLM(str(folder), loss_chunk_mib=0.002)
    for module in (plain, chunked):
        module.model.eval()
        add_adapters(module, "lora", ["q_proj", "v_proj"], r=2, options={"init_lora_weights": False})
    chunked.load_state_dict(plain.state_dict())
    x = torch.randint(0, plain.model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    y = torch.roll(x, -1, 1)
    y[:, -1] = -100
    grads = []
    for module in (plain, chunked):
        loss = module.batch_loss((x, y))
        grads.append(torch.autograd.grad(loss, [p for p in module.parameters() if p.requires_grad]))
    for g, e in zip(*reversed(grads)):
        _close(g, e)
    with torch.no_grad():  # validation: the loss only
        torch.testing.assert_close(chunked.batch_loss((x, y)), plain.batch_loss((x, y)), **FP32)


def test_chunks_are_balanced_never_longer_than_the_budget_and_as_few():
    from lit_speed.memory.chunked_lm_loss import balanced_chunk

    for tokens in range(1, 60):
        for most in range(1, 25):
            size = balanced_chunk(tokens, most)
            assert 1 <= size <= most
            chunks = -(-tokens // size)
            assert chunks == -(-tokens // most)  # as few chunks as the budget allows
            assert tokens - (chunks - 1) * size >= size - chunks + 1  # the last one is no stub
    assert balanced_chunk(2048, 220) == 205 and balanced_chunk(2048, 883) == 683


def test_auto_candidates_double_the_default_chunk_within_the_cap():
    from lit_speed.memory.chunked_lm_loss_callback import AUTO_ENOUGH_TOKENS, auto_chunk_candidates

    assert auto_chunk_candidates(151_936) == [220, 440, 880]  # Qwen2.5's vocabulary, float32 logits
    assert auto_chunk_candidates(151_936, torch.bfloat16) == [147, 294, 588]  # + a 16-bit copy per logit
    assert auto_chunk_candidates(32_000) == [1048, 2096, 4192]
    assert auto_chunk_candidates(V) == [128 * 2**20 // (V * 4)]  # a small vocabulary: nothing to time
    assert auto_chunk_candidates(V)[0] >= AUTO_ENOUGH_TOKENS


def test_auto_times_larger_chunks_at_fit_start_and_a_resumed_run_keeps_its_choice(tmp_path, monkeypatch):
    import lit_speed.memory.chunked_lm_loss_callback as callback_module

    monkeypatch.setenv("LIT_SPEED_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(callback_module, "DEFAULT_CHUNK_MIB", 0.002)  # 5 tokens of 97 logits: candidates 5, 10, 20
    seen = []

    class Spy(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(vars(pl_module.lm)["forward"].chunk_bytes)

    torch.manual_seed(0)
    plain, chunked = OwnHFModule(), OwnHFModule()
    chunked.load_state_dict(plain.state_dict())
    callback = ChunkedLMLoss()
    _fit(plain, [], tmp_path)
    _fit(chunked, [callback, Spy()], tmp_path)
    assert set(callback.decision.times) == {"5", "10", "20"}  # timed here, every candidate
    tokens = int(callback.decision.chosen)
    assert callback.chunk_mib == tokens * V * 4 / 2**20 and set(seen) == {callback.chunk_bytes}
    assert callback.final_summary()["auto"].startswith("loss.chunk_tokens -> ")
    for (name, a), b in zip(plain.state_dict().items(), chunked.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=name)  # the math is the plain loss's

    def no_timing(*args, **kwargs):
        raise AssertionError("a resumed run must not time again")

    monkeypatch.setattr(callback_module, "measured_choice", no_timing)
    resumed = ChunkedLMLoss()
    resumed.load_state_dict({"chunk_mib": 0.0037})
    seen.clear()
    _fit(OwnHFModule(), [resumed, Spy()], tmp_path)
    assert resumed.chunk_mib == 0.0037 and resumed.decision.chosen == "restored"
    assert set(seen) == {int(0.0037 * 2**20)}
    assert ChunkedLMLoss(chunk_mib=64).state_dict() == {}  # a number is the config's: nothing to restore



def test_auto_times_in_the_dtype_the_head_computes_in(tmp_path, monkeypatch):
    """A bf16-true model's hidden states are bf16 (16-bit copies per logit: fewer tokens per chunk); float32
    adapters around a bf16-held head compute in float32."""
    from lit_speed.memory.chunked_lm_loss_callback import choose_chunk_tokens

    monkeypatch.setenv("LIT_SPEED_CACHE_DIR", str(tmp_path))
    weight = (torch.randn(151_936, 8) * 0.02).bfloat16()
    assert set(choose_chunk_tokens(weight).times) == {"147", "294", "588"}
    assert set(choose_chunk_tokens(weight, hidden_dtype=torch.float32).times) == {"220", "440", "880"}

def test_auto_is_refused_in_other_spellings():
    with pytest.raises(ValueError, match=r"ChunkedLMLoss\(chunk_mib='fast'\): .* or 'auto' .*Fix: chunk_mib=auto"):
        ChunkedLMLoss(chunk_mib="fast")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: times the chunk sizes on the GPU")
def test_auto_times_the_chunk_on_the_gpu_and_the_loss_stays_the_plain_one():
    from lit_speed.memory.chunked_lm_loss_callback import auto_chunk_candidates, choose_chunk_tokens

    torch.manual_seed(0)
    weight = (torch.randn(151_936, 64) * 0.02).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        decision = choose_chunk_tokens(weight, context=lambda: torch.autocast("cuda", dtype=torch.bfloat16))
    candidates = auto_chunk_candidates(151_936, torch.bfloat16)
    assert set(decision.times) == {str(c) for c in candidates} and int(decision.chosen) in candidates
    assert all(t is not None and t > 0 for t in decision.times.values())  # each ran on the GPU
    hidden = torch.randn(2, 300, 64, device="cuda", requires_grad=True)
    targets = torch.randint(0, 151_936, (2, 300), device="cuda")
    chunk = int(decision.chosen) * 151_936 * 4
    got = chunked_lm_loss(hidden, weight, targets, chunk_bytes=chunk)
    _close(got, _plain(hidden, weight, targets))
