"""The chunked loss's chunk size at real size, paired in one process: the same model steps alternately with each size.

    python benchmarks/bench_loss_chunk.py                      # Qwen2.5-0.5B dims, LoRA r=8, 4 x 512 tokens, 8 steps
    python benchmarks/bench_loss_chunk.py --layers 4 --steps 4 # the head's share larger, a shorter run
    python benchmarks/bench_loss_chunk.py --vary up_grad       # LoRA's up-projection gradient, standard vs transposed

Why paired: on a shared 2-core host two identical training runs steadied 8-9% apart (RESULTS.md, issue 31), more
than a chunk size moves. Here one process holds one model (the 0.5B-dims folder's config, random weights,
``model_folders.py``), LoRA on every linear layer, the chunked loss of ``lit_speed.memory.hf_chunked_loss``, glibc told
what ``keep_freed_memory`` tells it (set in the environment before the process starts, see below), fused AdamW; after
one warm-up step the chunk size alternates in ABBA order (220 then 880 tokens and so on: the 128 MiB default and
``chunk_mib=auto``'s largest candidate on Qwen2.5's 151,936-token vocabulary in float32), so a drift of the host
hits both alike. Eager decoder layers (the head is outside the compiled region in lit_speed's rows either way).
Also times ``choose_chunk_tokens`` (what ``chunk_mib=auto`` costs at fit start, uncached). Result:
``benchmarks/results/loss_chunk.json`` and a dated line in ``LOG.md``.

``--vary up_grad`` pairs the same way LoRA's up-projection weight gradient computed ``standard`` (``nn.Linear``'s
``dY^T h``) and ``transposed`` (``(h^T dY)^T``, :mod:`lit_speed.finetune.adapter_grad`) at ``chunk_mib=auto``'s
880-token chunks, and times ``choose_up_grad`` (what ``peft.up_grad=auto`` costs at fit start, uncached); result
``up_grad.json``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, machine, write_result  # noqa: E402
from model_folders import build  # noqa: E402

sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--layers", type=int, default=0, help="decoder layers kept (0: all)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps, ABBA order (a multiple of 4)")
    parser.add_argument("--sizes", default="220,880", help="two chunk sizes in tokens")
    parser.add_argument("--vary", choices=("chunk", "up_grad"), default="chunk",
                        help="what alternates: the loss chunk (--sizes) or LoRA's up-projection gradient")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    if os.environ.get("MALLOC_MMAP_MAX_") != "0":  # glibc reads it at start: re-run this process with it set
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "2147483647"})

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from lit_speed.finetune.adapter_grad import choose_up_grad, set_up_grad
    from lit_speed.memory.chunked_lm_loss import bytes_per_logit
    from lit_speed.memory.chunked_lm_loss_callback import choose_chunk_tokens
    from lit_speed.memory.hf_chunked_loss import chunk_hf_loss, set_chunk_bytes

    print("machine:", machine().get("cpu"), machine().get("cpu_flags", ""), flush=True)
    cfg = AutoConfig.from_pretrained(build(args.model))
    if args.layers:
        cfg.num_hidden_layers = args.layers
        cfg.layer_types = cfg.layer_types[:args.layers]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    model.train()
    hf = model.base_model.model
    chunk_hf_loss(hf, 128 * 2**20)
    vocab = hf.get_output_embeddings().weight.shape[0]
    start = time.perf_counter()
    os.environ["LIT_SPEED_AUTO_CACHE"] = "0"
    decision = choose_chunk_tokens(hf.get_output_embeddings().weight)
    auto_s = time.perf_counter() - start
    print(f"chunk_mib=auto at fit start: {auto_s:.2f} s, {decision.line()}", flush=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4, fused=True)
    ids = torch.randint(0, min(vocab, 20000), (4, 512), generator=torch.Generator().manual_seed(0))
    if args.vary == "up_grad":
        start = time.perf_counter()
        decision = choose_up_grad(model, tokens=ids.numel())
        auto_s = time.perf_counter() - start
        print(f"peft.up_grad=auto at fit start: {auto_s:.2f} s, {decision.line()}", flush=True)
        set_chunk_bytes(hf, 880 * vocab * bytes_per_logit(torch.float32))
        a, b = "standard", "transposed"
    else:
        a, b = [int(s) for s in args.sizes.split(",")]

    def step(variant: int | str) -> float:
        if args.vary == "up_grad":
            set_up_grad(model, variant)
        else:
            set_chunk_bytes(hf, variant * vocab * bytes_per_logit(torch.float32))
        begin = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - begin

    unit = "" if args.vary == "up_grad" else " tokens"
    warm = step(b)
    print(f"warm-up step ({b}{unit}): {warm:.1f} s", flush=True)
    order = ([a, b, b, a] * (args.steps // 4 + 1))[:args.steps]
    times: dict[int | str, list[float]] = {a: [], b: []}
    for variant in order:
        times[variant].append(step(variant))
        print(f"{variant}{unit}: {times[variant][-1]:.2f} s", flush=True)
    mean = {k: statistics.mean(v) for k, v in times.items()}
    ratio = mean[b] / mean[a]
    print(f"mean step: {a}{unit} {mean[a]:.2f} s, {b}{unit} {mean[b]:.2f} s (x{ratio:.3f})")
    results = {"model": args.model, "layers": cfg.num_hidden_layers, "vary": args.vary, "tokens_per_step": 2048,
               "warmup_s": warm,
               "steps_s": {str(k): v for k, v in times.items()}, "mean_s": {str(k): v for k, v in mean.items()},
               "ratio": ratio, "auto_decision": decision.line(), "auto_s": auto_s, "order": order}
    what = ("LoRA up-projection gradient" if args.vary == "up_grad" else "chunk")
    setting = "peft.up_grad=auto" if args.vary == "up_grad" else "chunk_mib=auto"
    write_result(f"{'up_grad' if args.vary == 'up_grad' else 'loss_chunk'}{args.tag}", results,
                 f"{args.model} dims, {cfg.num_hidden_layers} layers, LoRA r=8, 4 x 512 tokens fp32, eager layers, "
                 f"paired ABBA steps: {what} {a}{unit} {mean[a]:.2f} s, {b}{unit} {mean[b]:.2f} s per step "
                 f"(x{ratio:.3f}); {setting}'s timing {auto_s:.1f} s -> {decision.chosen}{unit}")


if __name__ == "__main__":
    main()
