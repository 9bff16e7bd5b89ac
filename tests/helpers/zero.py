"""A tiny charlm run under ZeroStrategy or DDP, usable in-process and as a script (one JSON file per rank).

As a script it is what Lightning re-launches for ``devices=2`` and what torchrun starts::

    python tests/helpers/zero.py --strategy zero --stage 2 --devices 2 --out /tmp/run

The training data is read in order (no shuffle): one process with batch 2b sees exactly the samples two
processes with batch b see, so their losses are comparable step by step.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
ROOT = Path(__file__).resolve().parents[2]  # children import lit_speed and tests.helpers from here (clean_env)

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler, Subset  # noqa: E402

from lit_speed.data.charlm import CharLMDataModule  # noqa: E402
from lit_speed.models.gpt import GPTModule  # noqa: E402
from lit_speed.run.process_end import end_distributed_process  # noqa: E402
from lit_speed.strategies.memory_estimate import measured_optimizer_state_bytes  # noqa: E402

CORPUS_BYTES = 200_000


class OrderedCharLM(CharLMDataModule):
    """charlm with the training windows in corpus order (deterministic across world sizes).

    ``train_windows`` keeps only the first windows, so an epoch is a known number of batches.
    """

    def __init__(self, *args: Any, train_windows: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.train_windows = train_windows

    def train_dataloader(self) -> DataLoader:
        # an explicit ordered sampler (the Trainer runs with use_distributed_sampler=False): rank r of n takes
        # windows r, r+n, r+2n, ... in every epoch
        ds = self.train_dataset
        if self.train_windows is not None:
            ds = Subset(ds, range(self.train_windows))
        dist = torch.distributed.is_available() and torch.distributed.is_initialized()
        sampler = DistributedSampler(ds, shuffle=False) if dist else SequentialSampler(ds)
        return DataLoader(ds, batch_size=self.batch_size, sampler=sampler)


class RecordingGPT(GPTModule):
    """GPTModule that keeps every training loss (per micro-batch, this rank's) in ``self.losses``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss.detach()))
        return loss


DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE",
            "GROUP_RANK", "TORCHELASTIC_RUN_ID", "CROSS_RANK", "CROSS_SIZE")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without the distributed variables an in-process fit left behind.

    Lightning/DeepSpeed export MASTER_PORT etc. into ``os.environ``; a child inheriting them would try to
    listen on a port this process still holds (EADDRINUSE) or join the wrong group.
    The checkout's root comes first on ``PYTHONPATH``: a child imports ``lit_speed`` and ``tests.helpers`` from
    this checkout (also when it runs this file as a script), not from wherever the package is installed.
    """
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    path = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**env, "PYTHONPATH": path, "DS_ACCELERATOR": "cpu", **extra}


def optimizer_factory(name: str, lr: float = 3e-3) -> Any:
    if name == "adamw":
        return functools.partial(torch.optim.AdamW, lr=lr, betas=(0.9, 0.99))
    if name == "sgd":
        return functools.partial(torch.optim.SGD, lr=lr * 30)
    if name == "cpu_adam":
        from lit_speed.optim.cpu_adam import CPUAdam

        return functools.partial(CPUAdam, lr=lr, betas=(0.9, 0.99), adamw_mode=True)
    raise ValueError(f"optimizer must be adamw|sgd|cpu_adam, got {name!r}")


def make_run(cache_dir: str | Path, batch_size: int = 8, optimizer: str = "adamw", n_embd: int = 32,
             n_layer: int = 2, seed: int = 0, train_windows: int | None = None) -> tuple[OrderedCharLM, RecordingGPT]:
    pl.seed_everything(seed, verbose=False)
    dm = OrderedCharLM(cache_dir=str(cache_dir), block_size=32, batch_size=batch_size, max_bytes=CORPUS_BYTES,
                       train_windows=train_windows)
    model = RecordingGPT(block_size=32, n_layer=n_layer, n_head=2, n_embd=n_embd,
                         optimizer=optimizer_factory(optimizer))
    return dm, model


def make_strategy(name: str, stage: int = 2, offload: bool = False) -> Any:
    if name == "ddp":
        return "ddp"
    from lit_speed.strategies.zero_strategy import ZeroStrategy

    return ZeroStrategy(stage=stage, offload_optimizer=offload, offload_parameters=offload and stage == 3)


def make_trainer(strategy: Any, devices: int = 1, max_steps: int = 6, root: str | Path | None = None,
                 **kwargs: Any) -> pl.Trainer:
    kwargs.setdefault("enable_checkpointing", any(isinstance(c, pl.callbacks.ModelCheckpoint)
                                                  for c in kwargs.get("callbacks", [])))
    return pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps,
                      logger=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                      use_distributed_sampler=False,
                      default_root_dir=root, **kwargs)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", choices=["zero", "ddp"], default="zero")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--offload", action="store_true")
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=32)
    p.add_argument("--train-windows", type=int, default=None, help="windows per epoch (for resume tests)")
    p.add_argument("--save-every", type=int, default=None, help="ZeRO checkpoint folder every N steps, in --out")
    p.add_argument("--resume", default=None, help="checkpoint folder to resume from")
    p.add_argument("--cache", required=True)
    p.add_argument("--out", required=True, help="folder for rank<k>.json")
    a = p.parse_args(argv)
    dm, model = make_run(a.cache, a.batch, a.optimizer, n_embd=a.n_embd, train_windows=a.train_windows)
    out = Path(a.out)
    callbacks = [] if a.save_every is None else [
        pl.callbacks.ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=a.save_every, save_top_k=-1)]
    trainer = make_trainer(make_strategy(a.strategy, a.stage, a.offload), a.devices, a.steps, callbacks=callbacks)
    trainer.fit(model, dm, ckpt_path=a.resume)
    out.mkdir(parents=True, exist_ok=True)
    result = {"rank": trainer.global_rank, "world_size": trainer.world_size, "losses": model.losses,
              "global_step": trainer.global_step,
              "optimizer_state_bytes": measured_optimizer_state_bytes(trainer.optimizers[0]),
              "num_params": sum(p.numel() for p in model.parameters())}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    end_distributed_process()  # barrier, group released, exit hooks run, no interpreter finalization


if __name__ == "__main__":
    main()
