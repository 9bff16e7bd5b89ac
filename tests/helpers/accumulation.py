"""Tiny modules, data and run helpers shared by the accumulation tests (module level, so ddp_spawn can pickle them)."""
from __future__ import annotations

import copy
from typing import Any, Iterator

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

PAD = -100


class TinyClassifier(pl.LightningModule):
    """Linear 8 -> 16 -> 4 classifier returning the mean cross-entropy of its micro-batch."""

    def __init__(self, lr: float = 0.5, oom_at_batch: int | None = None, oom_above: int = 0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.lr = lr
        self.oom_at_batch = oom_at_batch  # inject one OOM at this batch index for micro-batches > oom_above
        self.oom_above = oom_above
        self.oom_raised = False
        self.seen_batch_sizes: list[tuple[int, int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if (self.oom_at_batch is not None and not self.oom_raised and batch_idx == self.oom_at_batch
                and len(x) > self.oom_above):
            self.oom_raised = True
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)")
        self.seen_batch_sizes.append((self.global_step, len(x)))
        loss = F.cross_entropy(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class TinyTokenLM(pl.LightningModule):
    """Embedding + linear LM; mean cross-entropy over non-padding tokens of its micro-batch."""

    def __init__(self, vocab: int = 11, lr: float = 0.5) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, 12)
        self.head = nn.Linear(12, vocab)
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.head(torch.tanh(self.emb(x)))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1), ignore_index=PAD)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class TinyDataModule(pl.LightningDataModule):
    """Wraps a dataset with a settable ``batch_size`` (what ``micro_batch`` / ``"auto"`` adjusts)."""

    def __init__(self, dataset: TensorDataset, batch_size: int) -> None:
        super().__init__()
        self.dataset = dataset
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False)


class ManualModule(TinyClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        return None


def classification_data(n: int = 32, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g))


def token_data(n: int = 32, length: int = 10, seed: int = 2) -> TensorDataset:
    """Sequences padded to ``length`` with very different real lengths (1..length), so token counts vary."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 11, (n, length), generator=g)
    y = torch.randint(0, 11, (n, length), generator=g)
    lengths = torch.randint(1, length + 1, (n,), generator=g)
    lengths[: n // 4] = 1  # the first micro-batch is almost all padding
    y[torch.arange(length)[None, :] >= lengths[:, None]] = PAD
    return TensorDataset(x, y)


def flat_params(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def fit(module: pl.LightningModule, loader: Any, callbacks: list[Callback] | None = None,
        ckpt_path: str | None = None, datamodule: pl.LightningDataModule | None = None,
        **trainer_kwargs: Any) -> pl.Trainer:
    kwargs = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, max_epochs=1)
    kwargs.update(trainer_kwargs)
    callbacks = list(callbacks or [])
    if kwargs.get("devices", 1) != 1:  # spawned workers end by Python's finalization: release the group before it
        callbacks.append(ReleaseGroupAtExit())
    trainer = pl.Trainer(callbacks=callbacks, **kwargs)
    trainer.fit(module, loader, datamodule=datamodule, ckpt_path=ckpt_path)
    return trainer


def update(module: pl.LightningModule, loader: DataLoader, callbacks: list[Callback] | None = None,
           **trainer_kwargs: Any) -> torch.Tensor:
    """Parameter change of a copy of ``module`` after fitting it."""
    module = copy.deepcopy(module)
    before = flat_params(module)
    fit(module, loader, callbacks, **trainer_kwargs)
    return flat_params(module) - before


class StepRecorder(Callback):
    """Records, for each optimizer step, the global step and the batch indices that fed it."""

    def __init__(self) -> None:
        self.batches: list[int] = []
        self.steps: list[tuple[int, list[int]]] = []
        self.factors: list[int] = []

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        self.batches.append(batch_idx)

    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Any) -> None:
        self.steps.append((trainer.global_step, self.batches))
        self.factors.append(trainer.accumulate_grad_batches)
        self.batches = []


class ResumableLoader:
    """A sequential loader over a fixed list of batches whose position survives a checkpoint.

    The position saved is the number of batches handed out. (For a loader with a length, Lightning 2.6.6
    does not fetch ahead, so this is the number of batches the training step has seen.)
    """

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches
        self.fetched = 0
        self.start = 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        start, self.start = self.start, 0
        for i in range(start, len(self.batches)):
            self.fetched = i + 1
            yield self.batches[i]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.fetched}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["position"]


class ShardedDataModule(pl.LightningDataModule):
    """In-order shards per rank (``DistributedSampler(shuffle=False)``), so rank r reads samples r, r+W, ..."""

    def __init__(self, dataset: TensorDataset, batch_size: int) -> None:
        super().__init__()
        self.dataset = dataset
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        from torch.utils.data.distributed import DistributedSampler

        sampler = DistributedSampler(self.dataset, num_replicas=self.trainer.world_size,
                                     rank=self.trainer.global_rank, shuffle=False)
        return DataLoader(self.dataset, batch_size=self.batch_size, sampler=sampler)


class ReleaseGroupAtExit(Callback):
    """In each spawned worker: the process group released (and DDP's cycles collected) by an atexit hook, so no gloo
    worker thread is left when the interpreter finalizes (``process_end.release_process_group_at_exit``)."""

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        from lit_speed.run.process_end import release_process_group_at_exit

        release_process_group_at_exit()


class SyncCounter(Callback):
    """Writes, per rank, which batch indices ran a DDP gradient all-reduce (through a counting comm hook)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.calls = 0
        self.synced: list[int] = []

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def counting_hook(state: Any, bucket: Any) -> Any:
            self.calls += 1
            return allreduce_hook(state, bucket)

        # DDP checks real annotation objects (this file's are strings under `from __future__ import annotations`)
        counting_hook.__annotations__ = {"state": object, "bucket": torch.distributed.GradBucket,
                                         "return": torch.futures.Future[torch.Tensor]}
        trainer.strategy.model.register_comm_hook(None, counting_hook)

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.calls:
            self.synced.append(batch_idx)
        self.calls = 0

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        import json
        import os

        with open(os.path.join(self.out_dir, f"synced_rank{trainer.global_rank}.json"), "w") as f:
            json.dump(self.synced, f)
