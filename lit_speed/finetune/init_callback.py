"""Start a run from weights: a checkpoint, a state_dict, a safetensors file or a Hugging Face folder.

Unlike ``ckpt_path`` (which resumes the whole trainer: optimizer, loops, RNG), this copies the weights only, so a
fine-tuning run starts fresh from a pretrained model. The work is done by :func:`~lit_speed.finetune.weights.
load_weights`; this callback only schedules it (before the optimizer exists) and reports it.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lit_speed.finetune.weights import LoadReport, load_weights


def pretrain_once(path: str | Path, overrides: Sequence[str], run_dir: str | Path | None = None) -> Path:
    """Make sure ``path`` holds weights: if it does not exist, train them with ``scripts/train.py <overrides>``.

    The run writes into ``run_dir`` (default: next to ``path``); its ``checkpoints/last.ckpt`` is copied to
    ``path`` atomically, so a later call (or another process) reuses it and never trains twice.

    Raises:
        ValueError: The pretraining run failed (its exit code and the command to run it by hand).
    """
    path = Path(path).expanduser()
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:  # one process trains, the others wait and reuse
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return path
        return _pretrain(path, overrides, run_dir)


def _pretrain(path: Path, overrides: Sequence[str], run_dir: str | Path | None) -> Path:
    root = Path(os.environ.get("LIT_SPEED_ROOT", Path(__file__).resolve().parents[2]))
    run_dir = Path(run_dir) if run_dir else path.with_suffix("").with_name(path.stem + "_run")
    command = [sys.executable, str(root / "scripts" / "train.py"), *overrides, f"hydra.run.dir={run_dir}"]
    rank_zero_info(f"InitWeights: no weights at {path}; pretraining them first, once: {' '.join(command[1:])}")
    done = subprocess.run(command, cwd=root, env={**os.environ, "HYDRA_FULL_ERROR": "0"})
    last = run_dir / "checkpoints" / "last.ckpt"
    if done.returncode != 0 or not last.is_file():
        raise ValueError(f"InitWeights(pretrain={list(overrides)}): the pretraining run for {path} failed (exit "
                         f"{done.returncode}, no {last}; its own message is above). Fix: init.pretrain=[<overrides "
                         f"that train>], or init.path=<existing weights>. By hand: {' '.join(command)}")
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    shutil.copyfile(last, tmp)
    os.replace(tmp, path)
    return path


class InitWeights(Callback):
    """Initialise the model from a file or folder of weights before training starts (weights only).

    Runs before any adapter is added and before the optimizer exists: in ``scripts/train.py`` when the model is
    built (so a bad file is a ``Config error`` before anything starts), in a plain ``Trainer`` at ``setup``.
    A resumed run (``ckpt_path=``) loads its checkpoint after this, so resuming still restores everything.

    Args:
        path: A lit_speed/Lightning checkpoint, a ``torch.save`` state_dict, a ``.safetensors`` file or a Hugging
            Face model folder (``save_pretrained``).
        strict: Every tensor of the model must be in the file and the file must hold no other; ``False`` loads the
            tensors that match by name and shape and keeps the rest as initialised (e.g. a new head).
        pretrain: ``scripts/train.py`` overrides that produce the weights when ``path`` does not exist yet (the
            run's ``last.ckpt`` is copied to ``path``, then reused); empty: a missing ``path`` is an error.

    Raises:
        ValueError: Naming the first missing, unexpected or mis-shaped tensor, or an unsafe file (at load time).

    Example::

        trainer = Trainer(callbacks=[InitWeights("pretrained/model.safetensors", strict=False)])
    """

    def __init__(self, path: str, strict: bool = True, pretrain: Sequence[str] = ()) -> None:
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ValueError(f"InitWeights(path={path!r}): path must be a file or folder of weights. "
                             "Fix: init.path=<checkpoint, state_dict, .safetensors or save_pretrained folder>")
        if not isinstance(strict, bool):
            raise ValueError(f"InitWeights(strict={strict!r}): strict must be true or false")
        self.path = str(path)
        self.strict = strict
        self.pretrain = [str(o) for o in pretrain]
        self.report: LoadReport | None = None

    def prepare_model(self, model: nn.Module) -> None:
        """Load the weights into ``model`` (once; pretraining them first if configured and missing)."""
        if self.report is not None:
            return
        if self.pretrain and not Path(self.path).expanduser().exists():
            pretrain_once(self.path, self.pretrain)
        self.report = load_weights(model, self.path, self.strict)
        rank_zero_info(f"InitWeights: {self.report.describe()}")
        if 2 * self.report.loaded <= self.report.model_tensors:  # strict=false on weights of another model
            rank_zero_warn(f"InitWeights(path={self.path}, strict=False): only {self.report.loaded} of the model's "
                           f"{self.report.model_tensors} tensors were in the file; the rest trains from its random "
                           "initialisation. Check init.path holds this model's weights")

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self.prepare_model(pl_module)

    def describe(self) -> dict[str, str]:
        if self.report is None:
            return {"init weights": f"{self.path} ({'strict' if self.strict else 'non-strict'}, loaded at setup)"}
        return {"init weights": self.report.describe()}

    def final_summary(self) -> dict[str, Any]:
        report = self.report
        return {"path": self.path, "strict": self.strict, "kind": report.kind if report else None,
                "loaded_tensors": report.loaded if report else 0,
                "missing": list(report.missing[:20]) if report else [],
                "unexpected": list(report.unexpected[:20]) if report else []}
