"""Two ZeRO processes, a NaN loss on rank 1 only: run as a script, Lightning re-launches it for ``devices=2``.

``python tests/helpers/zero_guard_2p.py --out DIR --stage 2`` writes ``rank<r>.json`` per rank: for each step
whether the weights changed, the skipped-step count and the LR schedule's position.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # a script run: import this checkout

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lit_speed.precision.guarded_precision import GuardedPrecision  # noqa: E402
from lit_speed.run.process_end import end_distributed_process  # noqa: E402
from lit_speed.strategies.zero_strategy import ZeroStrategy  # noqa: E402

NAN_STEP, STEPS = 2, 5


class NaNOnRankOne(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 2)
        self.changed: list[bool] = []
        self._before: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch).pow(2).mean()
        return loss + float("nan") if self.global_step == NAN_STEP and self.global_rank == 1 else loss

    def on_train_batch_start(self, batch, batch_idx):
        self._before = [p.detach().clone() for p in self.parameters()]

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.changed.append(any(not torch.equal(a, p.detach()) for a, p in zip(self._before, self.parameters())))

    def train_dataloader(self):
        return DataLoader(torch.randn(64, 4, generator=torch.Generator().manual_seed(0)), batch_size=4)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.scheduler, "interval": "step"}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--stage", type=int, default=2)
    args = parser.parse_args()
    guard = GuardedPrecision("32-true", on_nonfinite="skip")
    module = NaNOnRankOne()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=args.stage, precision_plugin=guard),
                         max_steps=STEPS, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(module)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({
        "changed": module.changed, "skipped": guard.counters.skipped_steps,
        "schedule_steps": module.scheduler.last_epoch,
        "weights": [p.detach().flatten().tolist() for p in module.parameters()]}))
    end_distributed_process()  # barrier, group released, exit hooks run, no interpreter finalization


if __name__ == "__main__":
    main()
