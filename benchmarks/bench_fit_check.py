"""The fit check's probe at real size, with its matrix products skipped and computed, in one process.

    python benchmarks/bench_fit_check.py                    # Qwen2.5-0.5B dims, 4 x 512 tokens, LoRA and full

``lit_speed.run.memory_fit.fit_check`` runs a scaled probe of one training step (the real width and vocabulary at 1 and 2
layers) before the weights load, to refuse a run that will not fit in RAM. Its products return zeros of their shape
(``lit_speed.memory.memory_tracker.SkipMatmuls``): the same tensors are allocated, none of the FLOPs are spent. This
times the probe both ways (skip, compute, skip: a drift of the host shows in the two skip rows) for the speed rows'
lever sets of ``bench_real_size.py`` (chunked loss, compile, LoRA r=8 and full fine-tuning) and checks that the bytes it
predicts are the same. Result: ``benchmarks/results/fit_check.json`` and a dated line in ``LOG.md``.
"""
from __future__ import annotations

import argparse
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
    parser.add_argument("--tag", default="")
    args = parser.parse_args()

    from hydra import compose, initialize_config_dir

    from lit_speed.run.memory_fit import fit_check, fit_levers

    print("machine:", machine().get("cpu"), flush=True)
    folder = build(args.model)
    results: dict[str, dict] = {}
    for peft in ("lora", "none"):
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("train", overrides=[
                "model=hf_causal_lm", "data=text_folder", f"model.pretrained={folder}", "data.block_size=512",
                "data.batch_size=4", f"peft={peft}", "callbacks=[default,chunked_loss,keep_freed_memory,compile]"])
        levers = fit_levers.configured_levers(cfg)
        facts = fit_check.run_facts(cfg, folder, levers)
        row: dict[str, list] = {"skip_s": [], "compute_s": [], "step_bytes": []}
        for mode in ("skip", "compute", "skip"):
            start = time.perf_counter()
            probe = fit_check._probe(cfg, facts, levers, skip_matmuls=mode == "skip")[0]
            row[f"{mode}_s"].append(round(time.perf_counter() - start, 2))
            row["step_bytes"].append(probe.step_bytes(facts.layers, facts.vocab, facts.tokens))
            print(f"{peft}: probe, products {'skipped' if mode == 'skip' else 'computed'}: {row[f'{mode}_s'][-1]} s, "
                  f"step bytes {row['step_bytes'][-1]:,}", flush=True)
        row["same_bytes"] = len(set(row["step_bytes"])) == 1
        results["lora" if peft == "lora" else "full"] = row
    line = "; ".join(f"{name}: probe {min(r['compute_s'])} s computed, {' / '.join(map(str, r['skip_s']))} s skipped, "
                     f"same bytes {r['same_bytes']}" for name, r in results.items())
    write_result(f"fit_check{args.tag}", {"model": args.model, "tokens": 2048, **results},
                 f"fit check probe, {args.model} dims, 4 x 512 tokens, chunked loss: {line}")


if __name__ == "__main__":
    main()
