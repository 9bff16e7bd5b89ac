"""Peak RSS and step time of issue 32's two memory levers at a real vocabulary, one configuration per process.

A Qwen2.5-0.5B-shaped model cut to ``--layers`` decoder layers (hidden 896, 14/2 heads, vocabulary 151,936, tied
embeddings; random weights, nothing downloaded), micro-batch 4 x 512 tokens, plain torch loop (forward, backward,
AdamW step), float32:

    /usr/bin/time -v python benchmarks/bench_memory_levers.py --config full-plain    # and full-chunked, lora-*, ...

prints one JSON line (median step seconds over the steps after the first, the process's peak RSS from getrusage).
``--all`` runs every configuration in a fresh process each, in turn, and prints a table.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = {  # name: (adapters, chunked loss, grads_in_forward, bf16 base)
    "full-plain": (False, False, True, False),
    "full-chunked": (False, True, True, False),
    "full-chunked-recompute": (False, True, False, False),
    "lora-plain": (True, False, True, False),
    "lora-chunked": (True, True, True, False),
    "lora-bf16base": (True, False, True, True),
    "lora-chunked-bf16base": (True, True, True, True),
}


def run(name: str, layers: int, steps: int, batch: int, block: int, chunk_mib: float) -> dict:
    import torch
    import transformers

    import lit_speed
    from lit_speed.finetune.adapters import add_adapters

    adapters, chunked, in_forward, bf16_base = CONFIGS[name]
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                      num_hidden_layers=layers, num_attention_heads=14, num_key_value_heads=2,
                                      tie_word_embeddings=True, max_position_embeddings=block)
    model = transformers.Qwen2ForCausalLM(config).train()
    if adapters:
        add_adapters(model, "lora", ["all-linear"], r=16)
    if bf16_base:
        lit_speed.lower_frozen_base(model, compute="fp32")  # this CPU (Z3) has no native bf16
    if chunked:
        lit_speed.chunk_hf_loss(model, chunk_bytes=int(chunk_mib * 2**20))
        if not in_forward:  # the recompute-in-backward variant, for this measurement only
            import functools

            import lit_speed.memory.hf_chunked_loss as hcl
            hcl.chunked_lm_loss = functools.partial(lit_speed.chunked_lm_loss, grads_in_forward=False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        ids = torch.randint(0, 151936, (batch, block), generator=gen)
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"config": name, "layers": layers, "batch": batch, "block": block, "chunk_mib": chunk_mib,
            "step_s_median": statistics.median(times[1:]) if len(times) > 1 else times[0],
            "step_s": [round(t, 2) for t in times], "peak_rss_mib": round(peak / 2**20), "loss": float(loss)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS))
    parser.add_argument("--all", action="store_true")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--block", type=int, default=512)
    parser.add_argument("--chunk-mib", type=float, default=128)
    args = parser.parse_args()
    if args.config:
        print(json.dumps(run(args.config, args.layers, args.steps, args.batch, args.block, args.chunk_mib)))
        return
    rows = []
    for name in CONFIGS:
        out = subprocess.run([sys.executable, __file__, "--config", name, "--layers", str(args.layers), "--steps",
                              str(args.steps), "--batch", str(args.batch), "--block", str(args.block),
                              "--chunk-mib", str(args.chunk_mib)], capture_output=True, text=True)
        line = [s for s in out.stdout.splitlines() if s.startswith("{")]
        rows.append(json.loads(line[-1]) if line else {"config": name, "error": out.stderr[-500:]})
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
