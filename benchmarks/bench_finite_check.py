"""The non-finite guard's per-step gradient check at real size: one fused reduction against the per-tensor check.

    python benchmarks/bench_finite_check.py [--model qwen2.5-0.5b] [--repeats 5] [--device cpu|cuda]

GuardedPrecision checks every gradient for inf/NaN before every optimizer step. Gradients with the shapes of a real
open model's parameters (``model_folders.SPECS``: every parameter for full fine-tuning, float32 as the CPU trains
them; the r=8 LoRA adapters of the seven projections of every layer) are checked three ways, interleaved round by
round in the same run:

- ``isfinite_all``: ``torch.isfinite(g).all()`` per gradient, what one writes first (masks as large as ``g``);
- ``chunked``: lit_speed's check up to 761d3a9 (per gradient, in chunks of 4M elements, stacked): two launches per
  gradient chunk;
- ``all_finite``: today's ``lit_speed.tensors.all_finite`` (one ``torch._foreach_norm(ord=inf)`` per device and dtype).

Per variant: median seconds per check, kernels launched (the ops the check dispatches, counted under a dispatch
mode), and the peak of the check's temporaries (``LiveTensorTracker``). The three answers are compared on a gradient
with one NaN in the last element of the largest tensor. Numbers are ratios within one run; nothing here is a test.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from _common import stats, write_result  # noqa: E402
from model_folders import SPECS  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from lit_speed.memory.memory_tracker import LiveTensorTracker  # noqa: E402
from lit_speed.tensors import all_finite  # noqa: E402

CHUNK = 1 << 22
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def chunked(tensors: list[torch.Tensor]) -> torch.Tensor:
    """lit_speed's check up to 761d3a9 (lit_speed.tensors.finite + precision.nonfinite.all_finite)."""
    def one(t: torch.Tensor) -> torch.Tensor:
        if t.numel() <= CHUNK or not t.is_contiguous():
            return torch.isfinite(t).all()
        return torch.stack([torch.isfinite(c).all() for c in t.view(-1).split(CHUNK)]).all()
    return torch.stack([one(t) for t in tensors]).all()


def isfinite_all(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([torch.isfinite(t).all() for t in tensors]).all()


VARIANTS = {"isfinite_all": isfinite_all, "chunked": chunked, "all_finite": all_finite}


def shapes(name: str, mode: str) -> list[tuple[int, ...]]:
    s = SPECS[name]
    d, ff, layers = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    head = s.get("head_dim", d // s["num_attention_heads"])
    q, kv = s["num_attention_heads"] * head, s["num_key_value_heads"] * head
    proj = {"q_proj": (q, d), "k_proj": (kv, d), "v_proj": (kv, d), "o_proj": (d, q), "gate_proj": (ff, d),
            "up_proj": (ff, d), "down_proj": (d, ff)}
    if mode == "lora":
        return [sh for _ in range(layers) for out, inp in proj.values() for sh in ((8, inp), (out, 8))]
    per_layer = [*proj.values(), (d,), (d,)]
    if s["model_type"] == "qwen2":
        per_layer += [(q,), (kv,), (kv,)]  # Qwen2's q/k/v biases
    return [(s["vocab_size"], d), *[sh for _ in range(layers) for sh in per_layer], (d,)]


class OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(SPECS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args(argv)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    results: dict[str, dict] = {}
    for mode in ("full", "lora"):
        grads = [torch.full(sh, 1e-3, device=args.device) for sh in shapes(args.model, mode)]
        row: dict[str, dict] = {"tensors": len(grads), "elements": sum(g.numel() for g in grads)}
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for fn in VARIANTS.values():  # warm-up
            bool(fn(grads))
        for _ in range(args.repeats):  # interleaved, so drift hits every variant alike
            for name, fn in VARIANTS.items():
                sync()
                t0 = time.perf_counter()
                bool(fn(grads))
                times[name].append(time.perf_counter() - t0)
        largest = max(grads, key=torch.Tensor.numel)
        largest.view(-1)[-1] = float("nan")
        for name, fn in VARIANTS.items():
            with OpCount() as count:
                fn(grads)
            with LiveTensorTracker() as tracker:
                answer = bool(fn(grads))
            row[name] = {"s": stats(times[name]), "ops": count.ops, "temporaries_peak_bytes": tracker.peak_bytes,
                         "finds_the_nan": not answer}
        results[mode] = row
        del grads, largest
    full, lora = results["full"], results["lora"]
    line = (f"--model {args.model} --device {args.device} --repeats {args.repeats}: full fine-tuning's "
            f"{full['tensors']} gradients ({full['elements'] / 1e6:.0f}M float32): all_finite "
            f"{full['all_finite']['s']['median']:.3f} s vs chunked {full['chunked']['s']['median']:.3f} s "
            f"(x{full['all_finite']['s']['median'] / full['chunked']['s']['median']:.2f}) vs isfinite_all "
            f"{full['isfinite_all']['s']['median']:.3f} s; ops {full['all_finite']['ops']} vs "
            f"{full['chunked']['ops']} vs {full['isfinite_all']['ops']}; temporaries' peak "
            f"{full['all_finite']['temporaries_peak_bytes'] / 2**20:.1f} vs "
            f"{full['chunked']['temporaries_peak_bytes'] / 2**20:.1f} vs "
            f"{full['isfinite_all']['temporaries_peak_bytes'] / 2**20:.1f} MiB; LoRA's {lora['tensors']} gradients: "
            f"{lora['all_finite']['s']['median'] * 1e3:.2f} vs {lora['chunked']['s']['median'] * 1e3:.2f} ms, ops "
            f"{lora['all_finite']['ops']} vs {lora['chunked']['ops']}; every variant finds the NaN: "
            f"{all(r[v]['finds_the_nan'] for r in results.values() for v in VARIANTS)}")
    print(line)
    write_result(f"finite_check_{args.device}", {"model": args.model, "repeats": args.repeats, **results}, line)


if __name__ == "__main__":
    main()
