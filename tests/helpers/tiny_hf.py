"""A tiny Hugging Face causal LM and its tokenizer, built offline and saved with ``save_pretrained``.

Nothing is downloaded: the tokenizer is a byte-level BPE trained on a few standard-library files, the model a
2-layer, 64-wide Llama (or GPT-2) with random weights.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

STDLIB = Path(sysconfig.get_paths()["stdlib"])
TRAINING_FILES = ["textwrap.py", "string.py", "glob.py", "fnmatch.py"]


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


def save_tiny_causal_lm(folder: str | Path, arch: str = "llama", seed: int = 0, vocab_size: int = 300,
                        hidden: int = 64, layers: int = 2) -> Path:
    """Write a tiny causal LM (``llama`` or ``gpt2``, ``layers`` x ``hidden``) and its tokenizer to ``folder``."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    tokenizer = tiny_tokenizer(vocab_size)
    n_vocab = len(tokenizer)
    torch.manual_seed(seed)
    if arch == "llama":
        config = LlamaConfig(vocab_size=n_vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id)
        model = LlamaForCausalLM(config)
    elif arch == "gpt2":
        config = GPT2Config(vocab_size=n_vocab, n_embd=hidden, n_layer=layers, n_head=4, n_positions=256,
                            eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
        model = GPT2LMHeadModel(config)
    else:
        raise ValueError(f"arch must be llama or gpt2, got {arch!r}")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
