"""Script run by tests/curriculum/test_ddp.py under 2-process CPU DDP: each rank records what it trained on.

    python tests/helpers/curriculum.py OUT_DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import TensorDataset

from lit_speed.curriculum import CurriculumDataModule
from lit_speed.curriculum.sampler import CurriculumSampler, epoch_permutation, shard_of_allowed
from lit_speed.run.process_end import end_distributed_process

N, BS, PACE, STEPS = 64, 4, 6, 10


class Recorder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        self.seen.append(idx.tolist())
        return torch.nn.functional.mse_loss(self.layer(x).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main(out: Path) -> None:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(N, 2, generator=g), torch.randn(N, generator=g), torch.arange(N))
    dm = CurriculumDataModule(train_dataset=data, batch_size=BS, difficulty=torch.arange(N, dtype=torch.float),
                              pacing="linear", start_fraction=0.25, pace_duration=PACE, seed=1)
    model = Recorder()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0)
    trainer.fit(model, datamodule=dm)
    s = dm.sampler
    perm = epoch_permutation(N, s.seed, 0)
    shards = {str(gb): shard_of_allowed(s.order, s.n_allowed(gb), perm, s.rank, s.num_replicas).tolist()
              for gb in (0, PACE)}
    record = {"rank": trainer.global_rank, "world": trainer.world_size, "seen": model.seen, "shards": shards,
              "allowed": {str(gb): s.order[: s.n_allowed(gb)].tolist() for gb in (0, PACE)},
              "sampler_kept": isinstance(trainer.train_dataloader.sampler, CurriculumSampler)}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
    end_distributed_process()  # barrier, group released, exit hooks run, no interpreter finalization


if __name__ == "__main__":
    main(Path(sys.argv[1]))
