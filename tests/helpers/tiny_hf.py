"""A tiny Hugging Face causal LM and its tokenizer, built offline and saved with ``save_pretrained``.

Nothing is downloaded: the tokenizer is a byte-level BPE trained locally (the ``tokenizers`` library) on a few
standard-library files, the model a 2-layer, 64-wide Llama, GPT-2, Qwen2 (tied embeddings) or OPT (learned positions)
with random weights; a folder without tokenizer files, or with a vocabulary larger than the embedding, on request.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

STDLIB = Path(sysconfig.get_paths()["stdlib"])
TRAINING_FILES = ["textwrap.py", "string.py", "glob.py", "fnmatch.py"]


TEXT_FILES = ["csv.py", "shlex.py", "token.py", "calendar.py", "bisect.py", "heapq.py"]


def write_texts(folder: Path) -> Path:
    """A folder of six stdlib modules as ``.txt`` files: a text_folder corpus for the tiny models."""
    for name in TEXT_FILES:
        (folder / f"{name}.txt").write_text((STDLIB / name).read_text())
    return folder


def tiny_tokenizer(vocab_size: int = 300):
    """A byte-level BPE tokenizer trained on a few stdlib files, as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(((STDLIB / f).read_text() for f in TRAINING_FILES), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


ARCHS = ("llama", "gpt2", "qwen2", "opt")


#: ChatML's markers and a template that renders with them (a tokenizer with a chat template of its own)
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]
CHATML = ("{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{%- endif %}")


def save_tiny_causal_lm(folder: str | Path, arch: str = "llama", seed: int = 0, vocab_size: int = 300,
                        hidden: int = 64, layers: int = 2, max_positions: int = 256, tokenizer: bool = True,
                        model_vocab_size: int | None = None, chat: bool = False) -> Path:
    """Write a tiny causal LM and (unless ``tokenizer=False``) its tokenizer to ``folder``.

    Args:
        arch: ``llama`` (rotary, untied head), ``gpt2`` (learned positions, tied head), ``qwen2`` (rotary, tied
            embeddings) or ``opt`` (learned positions with OPT's offset of 2, tied head).
        vocab_size: The tokenizer's BPE vocabulary.
        max_positions: ``max_position_embeddings`` (``n_positions`` for GPT-2).
        tokenizer: Save the tokenizer files too; ``False`` leaves a folder of weights and ``config.json`` only.
        model_vocab_size: Embedding rows when they should differ from the tokenizer's vocabulary (default: equal).
        chat: Add ChatML's ``<|im_start|>``/``<|im_end|>`` as special tokens and :data:`CHATML` as the tokenizer's
            chat template (as an instruct model's folder has them).
    """
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        OPTConfig,
        OPTForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    folder = Path(folder)
    trained = tiny_tokenizer(vocab_size)
    if chat:
        trained.add_special_tokens({"additional_special_tokens": CHAT_TOKENS})
        trained.chat_template = CHATML
    n_vocab, eos = model_vocab_size or len(trained), trained.eos_token_id
    if arch in ("qwen2", "opt") and tokenizer and model_vocab_size is None:
        # AutoTokenizer loads the folder as the architecture's own class (Qwen2Tokenizer, GPT2Tokenizer), which adds
        # its special tokens: the embedding must hold the ids of the tokenizer a user will load
        from transformers import AutoConfig, AutoTokenizer

        folder.mkdir(parents=True, exist_ok=True)
        AutoConfig.for_model(arch).save_pretrained(folder)
        trained.save_pretrained(folder)
        trained = AutoTokenizer.from_pretrained(folder)
        n_vocab, eos = len(trained), trained.eos_token_id
    eos = min(eos, n_vocab - 1)
    torch.manual_seed(seed)
    if arch == "llama":
        config = LlamaConfig(vocab_size=n_vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                             tie_word_embeddings=False, eos_token_id=eos)
        model = LlamaForCausalLM(config)
    elif arch == "gpt2":
        config = GPT2Config(vocab_size=n_vocab, n_embd=hidden, n_layer=layers, n_head=4, n_positions=max_positions,
                            eos_token_id=eos, bos_token_id=eos)
        model = GPT2LMHeadModel(config)
    elif arch == "qwen2":
        config = Qwen2Config(vocab_size=n_vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                             tie_word_embeddings=True, eos_token_id=eos, bos_token_id=eos)
        model = Qwen2ForCausalLM(config)
    elif arch == "opt":
        config = OPTConfig(vocab_size=n_vocab, hidden_size=hidden, ffn_dim=2 * hidden, num_hidden_layers=layers,
                           num_attention_heads=4, max_position_embeddings=max_positions, word_embed_proj_dim=hidden,
                           eos_token_id=eos, bos_token_id=eos, pad_token_id=eos)
        model = OPTForCausalLM(config)
    else:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    model.save_pretrained(folder)
    if tokenizer:
        trained.save_pretrained(folder)
    return folder
