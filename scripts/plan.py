"""Will it fit? Rank training configurations by predicted peak memory and speed before launching.

    python scripts/plan.py experiment=charlm_cpu --budget-mib 32 --micro-batches 4,8,16,32

Takes the same overrides as ``scripts/train.py`` (they pick the model and data), measures the real module at two
probe micro-batches, and prints one row per configuration with the exact overrides that run it.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
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
    parser.add_argument("--budget-mib", type=float, default=None, help="device memory per process (MiB)")
    parser.add_argument("--micro-batches", type=_csv, default=["4", "8", "16", "32"], help="candidate sizes")
    parser.add_argument("--precisions", type=_csv, default=["32-true", "bf16-mixed"], help="Lightning literals")
    parser.add_argument("--checkpoint", type=_csv, default=None,
                        help="block types to checkpoint ('' = none; default: the model's repeated block types)")
    parser.add_argument("--strategies", type=_csv, default=["auto"], help="conf/strategy options")
    parser.add_argument("--world-size", type=int, default=1, help="processes")
    parser.add_argument("--top", type=int, default=20, help="rows to print")
    return parser.parse_known_args(argv)


def main(argv: list[str]) -> int:
    args, overrides = parse_args(argv)
    bad = [o for o in overrides if "=" not in o]
    if bad:
        print(f"Unknown argument(s) {bad}: give Hydra overrides as key=value and options as --name value",
              file=sys.stderr)
        return 2
    import hydra
    from rich.console import Console
    from rich.table import Table

    from lit_speed.run.config_check import preflight

    from lit_speed.run.config_error import ConfigError
    from lit_speed.memory.compile_model import repeated_block_types
    from lit_speed.memory.planner import plan

    if not all(b.isdigit() and int(b) > 0 for b in args.micro_batches):
        print(f"--micro-batches must be comma-separated positive integers, got {','.join(args.micro_batches)!r}; "
              f"e.g. --micro-batches 4,8,16", file=sys.stderr)
        return 2
    micro_batches = [int(b) for b in args.micro_batches]
    try:
        cfg = preflight(overrides)
    except ConfigError as error:
        print(f"Config error: {error}", file=sys.stderr)
        return 2
    base = [o for o in overrides if not o.startswith(("precision=", "data.batch_size=", "strategy=", "callbacks="))]
    optimizer = next((o.split("=", 1)[1] for o in overrides if o.startswith("optimizer=")), "adamw")
    datamodule = hydra.utils.instantiate(cfg.data)
    factory = hydra.utils.instantiate(cfg.optimizer)
    model = hydra.utils.instantiate(cfg.model, optimizer=factory)
    peft = cfg.get("peft")
    if peft is not None and "_target_" in peft:  # adapters on a frozen base: fewer gradients and optimizer state
        hydra.utils.instantiate(peft, export_dir=None).prepare_model(model)  # no run folder here
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    checkpoint = args.checkpoint
    if checkpoint is None:  # the repeated blocks (GPT: Block); a model without them gets no checkpointing rows
        checkpoint = sorted({cls.__name__ for cls in repeated_block_types(model)})
    budget = None if args.budget_mib is None else int(args.budget_mib * 2**20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = plan(model, batch, budget, micro_batches, args.precisions, checkpoint, args.strategies,
                      args.world_size, optimizer, factory, base)
    title = "configurations that fit" + (f" in {args.budget_mib:g} MiB" if budget else "") + ", fastest first"
    table = Table(title=title, title_justify="left")
    for name in ("#", "precision", "ckpt", "micro", "strategy", "peak MiB", "host MiB", "rel. speed"):
        table.add_column(name, justify="right" if name not in ("precision", "strategy") else "left")
    rows = result.table_rows(args.top)
    for i, row in enumerate(rows, 1):
        table.add_row(str(i), *row[:-1])
    console = Console(soft_wrap=True)
    console.print(table)
    for i, row in enumerate(rows, 1):  # plain print: brackets must not be read as rich markup
        print(f"#{i}: python scripts/train.py {row[-1]}")
    if not checkpoint:
        result.notes.append("no repeated block type in this model: no checkpointing rows (name one with --checkpoint)")
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
