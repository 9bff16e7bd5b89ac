"""Will it fit? Rank training configurations by predicted peak memory and speed before launching.

    python scripts/plan.py experiment=charlm_fast --budget-mib 32

Takes the same overrides as ``scripts/train.py``: the candidates default to what that run would use (its precision,
micro-batch, strategy, world size and optimizer, presets included; ``lit_speed.run.memory_fit.memory_plan``),
measures the real module at two probe micro-batches, and prints one row per configuration with the exact overrides
that run it; ``*`` marks the configured run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("LIT_SPEED_ROOT", str(ROOT))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-mib", type=float, default=None,
                        help="memory per process (MiB): a Hugging Face folder's rows are the process's peak RSS; "
                             "other models' rows are the step's tensors (a GPU's memory, or on a CPU the RAM beside "
                             "what the process itself holds)")
    parser.add_argument("--micro-batches", type=_csv, default=None,
                        help="candidate sizes (default: the config's, 4, 8, 16, 32)")
    parser.add_argument("--precisions", type=_csv, default=None,
                        help="modes (default: the config's, auto's candidates, 32-true and bf16-mixed)")
    parser.add_argument("--checkpoint", type=_csv, default=None,
                        help="block types to checkpoint ('' = none; default: the model's repeated block types)")
    parser.add_argument("--strategies", type=_csv, default=None, help="conf/strategy options (default: the config's)")
    parser.add_argument("--world-size", type=int, default=None, help="processes (default: the config's)")
    parser.add_argument("--top", type=int, default=20, help="rows to print")
    parser.add_argument("--json", type=Path, default=None,
                        help="also write the rows (a Hugging Face folder's lever sets: every part, bytes) to this file")
    return parser.parse_known_args(argv)


def plan_hf_run(cfg, budget: int | None, json_path: Path | None = None) -> int:
    """Every lever set of :func:`lit_speed.run.memory_fit.fit_levers.lever_sets` with its predicted peak RSS (no
    weights read).

    A run that trains on one GPU (``trainer=gpu``) gets the GPU's column too: its step's predicted GPU memory
    (:func:`~lit_speed.run.memory_fit.fit_check_gpu.gpu_step_bytes`) against ``budget`` (``--budget-mib``) or the
    device's free memory; its peak RSS is then the host side of a GPU run (loading, and the end of fit), not a CPU
    step's."""
    import psutil
    import torch
    from rich.console import Console
    from rich.table import Table

    from lit_speed.memory.host_memory import host_memory
    from lit_speed.memory.rss_estimate import gib
    from lit_speed.run.memory_fit import fit_check, fit_check_gpu, fit_levers

    process = psutil.Process().memory_info().rss
    configured = fit_levers.configured_levers(cfg)
    device = fit_check_gpu.gpu_to_judge(cfg)
    gpu = fit_check_gpu.trains_on_gpu(cfg)
    ram = process + host_memory().available
    if gpu:
        gpu_budget = budget if budget is not None else (
            torch.cuda.mem_get_info(device)[0] if device is not None and torch.cuda.is_available() else None)
        budget = ram
    else:
        gpu_budget, budget = None, budget if budget is not None else ram
    source = "this machine's free memory" if gpu else "--budget-mib or this machine's free memory"
    title = f"predicted peak RSS (budget {gib(budget)}: {source})"
    if gpu:
        title += "; the GPU step's memory (budget " + (gib(gpu_budget) if gpu_budget is not None else
                                                       "unknown here: --budget-mib") + ")"
    table = Table(title=title, title_justify="left")
    for name in ("#", "levers", "weights GiB", "optimizer GiB", "step GiB", "load GiB", "export GiB", "check GiB",
                 "peak RSS GiB",
                 *(("GPU GiB",) if gpu else ()), "fits"):
        table.add_column(name, justify="left" if name == "levers" else "right", no_wrap=name == "levers")
    first_fit = None
    commands, rows = [], []
    cache: dict = {}  # one probe per kind of row: rows that differ in micro-batch only share it
    for i, levers in enumerate(fit_levers.lever_sets(configured, not configured.lora)):
        estimate = fit_check.estimate_run(cfg, levers, 0 if gpu else process, cache=cache)
        fix = " ".join(levers.overrides(configured, list(fit_levers.callback_nodes(cfg)))) or "(as configured)"
        added = [short for name, short in (("chunked_loss", "chunk"), ("base_bf16", "bf16"), ("low_bit_states", "8bit"),
                                           ("checkpointing", "ckpt"), ("base_int8", "int8"), ("lora", "lora"))
                 if getattr(levers, name) and not getattr(configured, name)]
        if levers.micro_batch != configured.micro_batch:
            added.append(f"mb{levers.micro_batch}")
        gpu_part: dict = {}
        if gpu:  # the host holds the load and the end of fit; the step lives on the GPU
            load, end = fit_check_gpu.gpu_run_host_bytes(cfg, cache[("facts", levers.lora)], levers)
            peak = process + max(load, end)
            gpu_part = {"gpu_step": fit_check_gpu.gpu_step_bytes(estimate), "host_end": end}
            fits = peak <= budget and (gpu_budget is None or gpu_part["gpu_step"] <= gpu_budget)
        else:
            peak = estimate.peak
            fits = peak <= budget
        first_fit = first_fit if first_fit is not None or not fits else (i, fix)
        shown = [estimate.weights, estimate.optimizer, max(estimate.step, estimate.optimizer_step), estimate.load,
                 estimate.export, estimate.check, peak] + ([gpu_part["gpu_step"]] if gpu else [])
        table.add_row(f"{i}{'*' if i == 0 else ''}", "+".join(added) or "-", *(f"{b / 2**30:.2f}" for b in shown),
                      "yes" if fits else "no")
        commands.append(f"#{i}: {fix}")
        rows.append({"row": i, "overrides": fix, "fits": fits, **estimate.parts(), "peak": peak, **gpu_part})
    if json_path is not None:
        json_path.write_text(json.dumps({"budget": budget, "gpu_budget": gpu_budget, "rows": rows}, indent=1))
    Console(soft_wrap=True).print(table)
    for line in commands:  # plain print: brackets must not be read as rich markup
        print(line)
    if not gpu and rows and rows[0]["kept_peak"] > rows[0]["peak"]:
        print(f"#0 keeps freed memory (keep_freed_memory, a Hugging Face run's default): glibc's heaps may hold up to "
              f"{rows[0]['kept_peak'] / 2**30:.2f} GiB, handed back when memory runs short; not predicted, not judged. "
              "callbacks=[...,return_freed_memory] returns freed memory at once (slower steps)")
    if gpu and device is None:
        print("GPU column: the step of one process on one GPU (not judged for DDP or ZeRO: their state is per rank)")
    if first_fit is None:
        print("Nothing fits: a smaller model, data.block_size, or a machine with more memory")
        return 1
    print(f"cheapest that fits: #{first_fit[0]}: {first_fit[1]}")
    return 0


def main(argv: list[str]) -> int:
    args, overrides = parse_args(argv)
    bad = [o for o in overrides if "=" not in o]
    if bad:
        print(f"Unknown argument(s) {bad}: give Hydra overrides as key=value and options as --name value",
              file=sys.stderr)
        return 2
    from rich.console import Console
    from rich.table import Table

    from lit_speed.run.config_check import preflight
    from lit_speed.run.config_error import ConfigError
    from lit_speed.run.console import quiet_upstream_notices
    from lit_speed.run.memory_fit.memory_plan import describe_configured, plan_run

    quiet_upstream_notices()  # torchao's import lines (through transformers): nothing a plan uses

    if args.micro_batches is not None and not all(b.isdigit() and int(b) > 0 for b in args.micro_batches):
        print(f"--micro-batches must be comma-separated positive integers, got {','.join(args.micro_batches)!r}; "
              f"e.g. --micro-batches 4,8,16", file=sys.stderr)
        return 2
    if args.json is not None and not (args.json.parent.is_dir() and os.access(args.json.parent, os.W_OK)):
        print(f"--json {args.json}: its folder {args.json.parent} does not exist or is not writable; e.g. --json "
              "plan.json", file=sys.stderr)
        return 2
    budget = None if args.budget_mib is None else int(args.budget_mib * 2**20)
    try:
        cfg = preflight(overrides)
        from lit_speed.run.memory_fit.fit_check import hf_folder
        from lit_speed.run.refusals import config_paths, refusals_as_config_errors

        # a component that refuses its settings as it is built (a model folder that is not there) says so in one
        # line naming the setting, as scripts/train.py does
        with refusals_as_config_errors(lambda: True, config_paths(cfg)):
            if hf_folder(cfg) is not None:  # a Hugging Face model folder: the process's peak RSS, from the config
                return plan_hf_run(cfg, budget, args.json)
            result, configured = plan_run(cfg, overrides, budget, [int(b) for b in args.micro_batches or []] or None,
                                          args.precisions, args.checkpoint, args.strategies, args.world_size)
    except ConfigError as error:
        print(f"Config error: {error}", file=sys.stderr)
        return 2
    title = "configurations that fit" + (f" in {args.budget_mib:g} MiB" if budget else "") + ", fastest first " \
        "(peak MiB: the step's tensors per process, not the process's RSS)"
    table = Table(title=title, title_justify="left")
    columns = ("precision", "ckpt", "micro", "strategy", "peak MiB", "host MiB", "rel. speed")  # table_rows' cells
    for name in ("#", *columns):
        table.add_column(name, justify="right" if name not in ("precision", "strategy") else "left")
    shown = (result.fitting if budget else result.rows)[:args.top]
    rows = result.table_rows(args.top)
    for i, (row, cells) in enumerate(zip(shown, rows), 1):
        table.add_row(f"{i}{'*' if configured.matches(row) else ''}", *cells[:-1])
    console = Console(soft_wrap=True)
    console.print(table)
    for i, cells in enumerate(rows, 1):  # plain print: brackets must not be read as rich markup
        print(f"#{i}: python scripts/train.py {cells[-1]}")
    if args.json is not None:
        args.json.write_text(json.dumps({"budget": budget, "rows": [dict(zip((*columns, "overrides"), cells))
                                                                    for cells in rows]}, indent=1))
    print(describe_configured(configured))
    for note in result.notes:
        console.print(f"  note: {note}")
    if budget and not result.fitting:
        smallest = min(result.rows, key=lambda r: r.peak_bytes)
        console.print(f"Nothing fits in {args.budget_mib:g} MiB; the smallest is {smallest.peak_bytes / 2**20:,.1f} "
                      f"MiB: {smallest.command}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
