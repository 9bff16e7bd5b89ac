"""Turn a sharded ZeRO checkpoint folder into one fp32 Lightning ``.ckpt`` that needs no DeepSpeed to load.

``python scripts/consolidate.py <checkpoint_dir> <out.ckpt>`` is the command-line form.
"""
from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import torch


def consolidate_zero_checkpoint(checkpoint_dir: str | Path, output_file: str | Path, tag: str | None = None) -> Path:
    """Gather the fp32 master weights of every rank's shard into a single Lightning checkpoint file.

    The result holds ``state_dict`` (fp32, contiguous, unsharded), ``hyper_parameters`` and the loop/callback
    state, so ``MyModule.load_from_checkpoint(output_file)`` works in plain Lightning. Optimizer state is not
    included (resume training from the sharded folder instead; it keeps optimizer and LR-scheduler state).

    Args:
        checkpoint_dir: The folder Lightning wrote for the ZeRO checkpoint (e.g. ``.../step=100.ckpt/``).
        output_file: Where to write the consolidated ``.ckpt``.
        tag: DeepSpeed tag inside the folder; ``None`` = the one named in ``latest``.

    Raises:
        FileNotFoundError: If ``checkpoint_dir`` is not a DeepSpeed checkpoint folder.

    Example::

        consolidate_zero_checkpoint("logs/train/runs/x/checkpoints/last.ckpt", "model.ckpt")
        model = GPTModule.load_from_checkpoint("model.ckpt")
    """
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    checkpoint_dir, output_file = Path(checkpoint_dir), Path(output_file)
    if not checkpoint_dir.is_dir() or not ((checkpoint_dir / "latest").is_file() or tag):
        raise FileNotFoundError(
            f"checkpoint_dir={str(checkpoint_dir)!r} is not a DeepSpeed ZeRO checkpoint folder (expected a folder "
            "with a 'latest' file and a tag sub-folder, as Trainer.save_checkpoint writes under ZeroStrategy); "
            "a single-file .ckpt is already consolidated")
    output_file.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints per-tensor progress
        checkpoint: dict[str, Any] = convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_file, tag)
    # zero_to_fp32 returns views into one flat buffer: store each tensor on its own, in fp32
    checkpoint["state_dict"] = {k: v.detach().to(torch.float32).clone() for k, v in checkpoint["state_dict"].items()}
    checkpoint.pop("ds_config", None)
    checkpoint.pop("ds_version", None)
    torch.save(checkpoint, output_file)
    return output_file


def saved_world_size(checkpoint_dir: str | Path, tag: str = "checkpoint") -> int | None:
    """How many data-parallel ranks wrote a ZeRO checkpoint folder (one ``*optim_states.pt`` each), or ``None``."""
    folder = Path(checkpoint_dir) / tag
    if not folder.is_dir():
        return None
    return len(list(folder.glob("*optim_states.pt"))) or None


def check_resume_world_size(checkpoint_dir: str | Path, world_size: int) -> None:
    """Refuse, with the ways out, a resume whose world size differs from the one that saved the checkpoint.

    DeepSpeed 0.19 cannot re-partition ZeRO optimizer state for a new data-parallel size (it raises deep in
    ``load_checkpoint``); weights alone can move through :func:`consolidate_zero_checkpoint`.

    Raises:
        ValueError: If the folder was written by a different number of ranks.
    """
    saved = saved_world_size(checkpoint_dir)
    if saved is not None and saved != world_size:
        raise ValueError(
            f"ckpt_path={str(checkpoint_dir)!r} was saved by {saved} ZeRO rank(s) but this run has {world_size}: "
            "DeepSpeed cannot re-partition ZeRO optimizer state. Resume with Trainer(devices) x Trainer(num_nodes) = "
            f"{saved}, or consolidate the weights (python scripts/consolidate.py <dir> model.ckpt) and start a new "
            "run from them (optimizer and LR-scheduler state are then lost)")
