"""The checkpoint a run resumes from, checked before ``fit``: a folder DeepSpeed wrote or a file, written by this
model and this optimizer (each refusal names what does not match and the fix)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lit_speed.run.config_error import ConfigError


def is_deepspeed_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a folder DeepSpeed wrote (Lightning's ZeRO checkpoints): a ``latest`` tag file or a
    ``checkpoint/`` folder of ``*model_states.pt`` files, not merely a folder holding some ``.pt`` file."""
    return path.is_dir() and ((path / "latest").is_file() or (path / "checkpoint").is_dir()
                              or any(path.glob("*model_states.pt")))


def check_checkpoint_path(ckpt_path: Any) -> None:
    """A folder is a checkpoint only when DeepSpeed wrote it (``latest``, a ``checkpoint`` folder, ``*model_states.pt``)."""
    if ckpt_path is None or not isinstance(ckpt_path, str) or "://" in ckpt_path:
        return
    path = Path(ckpt_path)
    if path.is_dir() and not is_deepspeed_checkpoint(path):
        inside = sorted(p.name for p in path.glob("*.ckpt")) + sorted(p.name for p in path.glob("*.pt"))
        found = f" (it holds {', '.join(inside[:3])}{', ...' if len(inside) > 3 else ''})" if inside else ""
        example = path / inside[0] if inside else path / "checkpoints" / "last.ckpt"
        raise ConfigError(f"ckpt_path={ckpt_path}: is a folder, not a checkpoint{found}. Fix: pass a checkpoint file "
                          f"(e.g. ckpt_path={example}), or ckpt_path=last")


def _param_group_keys(optimizer_factory: Any) -> set[str] | None:
    """The param-group keys ``optimizer_factory`` gives every group, or ``None`` when it cannot be probed.

    The probe is a tiny ``Linear``'s parameters; an optimizer that needs parameter names (``wants_param_names``, e.g.
    ``MuonAdamW``) gets them as the bundled models pass them (``lit_speed.models.configure_optimizers.param_groups``).
    """
    probe = torch.nn.Linear(4, 4, bias=True)
    wants_names = bool(getattr(getattr(optimizer_factory, "func", optimizer_factory), "wants_param_names", False))
    named = list(probe.named_parameters())
    groups = [{"params": [p for _, p in named], "param_names": [f"probe.{n}" for n, _ in named]}] if wants_names \
        else [p for _, p in named]
    try:
        optimizer = optimizer_factory(groups)
    except Exception:  # noqa: BLE001 - a factory this probe cannot build: the check is skipped, never the run
        return None
    return set().union(*(set(g) for g in optimizer.param_groups)) - {"params", "param_names"}


def check_checkpoint_matches(ckpt_path: Any, model: torch.nn.Module, optimizer_factory: Any = None) -> None:
    """Refuse resuming a checkpoint written by another model or optimizer, naming what does not match.

    DeepSpeed's sharded folders are left to DeepSpeed; only single-file Lightning checkpoints are read.
    """
    if ckpt_path is None or not Path(str(ckpt_path)).is_file():
        return
    checkpoint = torch.load(str(ckpt_path), map_location="cpu", weights_only=False, mmap=True)
    saved = checkpoint.get("state_dict", {})
    mine = model.state_dict()
    if checkpoint.get("adapters_only"):  # PEFTAdapters: the trainable tensors only (it checks the frozen base)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        if trainable == {n for n, _ in model.named_parameters()}:
            raise ConfigError(f"ckpt_path={ckpt_path}: holds adapters only (written with peft=...), and this run trains "
                              "every parameter. Fix: the peft=/peft.* and init= options of the run that wrote it")
        mine = {k: v for k, v in mine.items() if k in trainable}
    missing, unexpected = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    reshaped = [k for k in set(mine) & set(saved) if tuple(mine[k].shape) != tuple(saved[k].shape)]
    if missing or unexpected or reshaped:
        what = (f"{len(missing)} of this model's tensors are missing (e.g. {missing[0]})" if missing else
                f"it holds {len(unexpected)} tensors this model lacks (e.g. {unexpected[0]})" if unexpected else
                f"{reshaped[0]} is {tuple(saved[reshaped[0]].shape)} there, {tuple(mine[reshaped[0]].shape)} here")
        raise ConfigError(f"ckpt_path={ckpt_path}: written by another model ({what}); {type(model).__name__} "
                          "cannot resume it. Fix: the model=/data=/model.* options of the run that wrote it, "
                          "or ckpt_path=null")
    states = checkpoint.get("optimizer_states") or []
    if optimizer_factory is None or not states or not states[0].get("param_groups"):
        return
    keys = _param_group_keys(optimizer_factory)
    if keys is None:
        return
    optional = {"initial_lr", "foreach", "fused", "differentiable", "capturable", "maximize", "decoupled_weight_decay"}
    needed = keys - optional
    saved_keys = set().union(*(set(g) for g in states[0]["param_groups"]))
    fix = "Fix: the optimizer= of the run that wrote it, or ckpt_path=null to start fresh"
    if needed - saved_keys:
        raise ConfigError(f"ckpt_path={ckpt_path}: written with another optimizer (its state lacks "
                          f"{', '.join(sorted(needed - saved_keys))}). {fix}")
    # a key that marks whose state it is (the low-bit AdamWs' state_bits): another optimizer would misread the state
    marks = {"state_bits"} & (saved_keys - keys)
    if marks:
        raise ConfigError(f"ckpt_path={ckpt_path}: written with another optimizer (its state carries "
                          f"{', '.join(sorted(marks))}, which this optimizer does not keep). {fix}")
