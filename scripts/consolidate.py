"""Consolidate a ZeRO checkpoint folder into one fp32 ``.ckpt``: ``python scripts/consolidate.py <dir> <out.ckpt>``.

The output loads with ``LightningModule.load_from_checkpoint`` and needs no DeepSpeed.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # consolidation runs on CPU; no GPU needed
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("checkpoint_dir", help="the ZeRO checkpoint folder (e.g. checkpoints/last.ckpt/)")
    parser.add_argument("output_file", help="the single-file .ckpt to write")
    parser.add_argument("--tag", default=None, help="DeepSpeed tag inside the folder (default: the 'latest' one)")
    args = parser.parse_args()
    from lit_speed.strategies.consolidate import consolidate_zero_checkpoint

    try:
        out = consolidate_zero_checkpoint(args.checkpoint_dir, args.output_file, args.tag)
    except FileNotFoundError as error:
        print(f"consolidate: {error}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
