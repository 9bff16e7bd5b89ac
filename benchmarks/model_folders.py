"""Model folders with the dimensions of real open models, built on this machine (nothing can be downloaded).

    python benchmarks/model_folders.py                       # builds both (once), prints their paths
    python benchmarks/model_folders.py qwen2.5-0.5b --show   # the path only (builds if missing)

Each folder is what ``save_pretrained`` writes for the published architecture (``config.json`` with the released
dimensions, ``model.safetensors`` in bfloat16 as released, random weights from ``from_config`` with a fixed seed)
plus a byte-level BPE tokenizer trained here on this Python's standard library, with its family's chat tokens and chat
template (Qwen2.5's ``<|im_start|>``/``<|im_end|>``, Llama 3's headers and ``<|eot_id|>``). The vocabulary the tokenizer knows
is smaller than the embedding (16,384 of 151,936 / 128,256 rows), as a real tokenizer's is a little smaller than its
padded embedding; every row of the embedding and the LM head still exists and costs its memory and FLOPs.

Shared by ``bench_real_size.py`` (speed and memory beside ``transformers.Trainer``) and anything else that must
measure at the size users train. Folders live in ``<repo>/.cache/model_folders/<name>`` (or ``--cache``).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "model_folders"
TOKENIZER_VOCAB = 16_384

#: The released configurations' dimensions (Hugging Face config.json of Qwen/Qwen2.5-0.5B and
#: meta-llama/Llama-3.2-1B), the keys that decide parameters, memory and FLOPs.
SPECS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {"model_type": "qwen2", "vocab_size": 151_936, "hidden_size": 896, "intermediate_size": 4864,
                     "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                     "max_position_embeddings": 32_768, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6,
                     "tie_word_embeddings": True, "hidden_act": "silu"},
    "llama-3.2-1b": {"model_type": "llama", "vocab_size": 128_256, "hidden_size": 2048, "intermediate_size": 8192,
                     "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                     "max_position_embeddings": 131_072, "rope_theta": 500_000.0, "rms_norm_eps": 1e-5,
                     "tie_word_embeddings": True, "hidden_act": "silu"},
}
#: Parameter counts of the released models, to check the folders against (embedding counted once when tied).
RELEASED_PARAMETERS = {"qwen2.5-0.5b": 494_032_768, "llama-3.2-1b": 1_235_814_400}

#: The chat tokens and template of each family's instruct release (Qwen2.5's published template without its tool
#: branch; Llama 3's header/eot format without the date preamble of 3.1+): instruction data is rendered with them.
CHAT = {
    "qwen2.5-0.5b": (["<|im_start|>", "<|im_end|>"], (
        "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
        "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
        "helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}{%- if message.role == 'user' "
        "or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}{{- '<|im_start|>' + "
        "message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}{%- endfor %}{%- if "
        "add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")),
    "llama-3.2-1b": (["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], (
        "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
        "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}{%- if "
        "add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")),
}


def add_chat_template(folder: Path, name: str) -> bool:
    """Give ``folder``'s tokenizer its family's chat tokens and template (once; a folder built before has neither).
    The tokens take ids after the trained vocabulary, inside the embedding's rows. Returns whether it changed."""
    from transformers import AutoTokenizer

    tokens, template = CHAT[name]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.chat_template == template:
        return False
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    if name.startswith("llama"):
        tokenizer.bos_token = "<|begin_of_text|>"
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    return True


def train_tokenizer(out: Path, vocab_size: int = TOKENIZER_VOCAB) -> Any:
    """A byte-level BPE tokenizer trained on this Python's standard library, saved into ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   bos_token="<|endoftext|>")
    fast.save_pretrained(out)
    return fast


def build(name: str, cache: Path = CACHE) -> Path:
    """The folder of ``name`` (one of :data:`SPECS`), built once: random bf16 weights, the released dimensions."""
    if name not in SPECS:
        raise SystemExit(f"model must be one of {sorted(SPECS)}, got {name!r}")
    out = cache / name
    if (out / "built.json").exists():
        add_chat_template(out, name)  # folders built before the chat template was added get it now
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    t0 = time.perf_counter()
    tmp = cache / f"{name}.tmp{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(tmp)
    add_chat_template(tmp, name)
    spec = dict(SPECS[name])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec, bos_token_id=tokenizer.eos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, dtype="bfloat16")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(tmp)
    del model
    record = {"name": name, "parameters": n_params, "released_parameters": RELEASED_PARAMETERS[name],
              "tokenizer_vocab": len(tokenizer), "build_s": round(time.perf_counter() - t0, 1)}
    (tmp / "built.json").write_text(json.dumps(record, indent=1))
    if out.exists():  # a half-built folder of an interrupted build
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", default=sorted(SPECS), help=f"of {sorted(SPECS)}")
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument("--show", action="store_true", help="print the path(s) only")
    args = parser.parse_args(argv)
    for name in args.names:
        path = build(name, args.cache)
        if args.show:
            print(path)
        else:
            print(f"{name}: {path} {json.loads((path / 'built.json').read_text())}")


if __name__ == "__main__":
    sys.exit(main())
