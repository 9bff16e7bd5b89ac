"""NextTokenSteps: Lightning's sanity check runs the validation step on one row of each batch; validation itself on
every row."""
from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import lit_speed
from lit_speed.models.gpt import GPTModule


class _Recorder(GPTModule):
    def __init__(self) -> None:
        super().__init__(vocab_size=17, block_size=8, n_layer=1, n_head=2, n_embd=16,
                         optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
        self.rows: list[tuple[bool, int]] = []  # (sanity checking, rows the loss saw)

    def batch_loss(self, batch):
        if not self.training:
            self.rows.append((self.trainer.sanity_checking, batch[0].shape[0]))
        return super().batch_loss(batch)


def _loader() -> DataLoader:
    x = torch.randint(0, 17, (12, 8), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.roll(-1, dims=1)), batch_size=4)


def test_the_sanity_check_validates_one_row_and_validation_every_row(tmp_path):
    model = _Recorder()
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=1, limit_val_batches=2,
                         num_sanity_val_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         default_root_dir=tmp_path)
    trainer.fit(model, train_dataloaders=_loader(), val_dataloaders=_loader())
    assert model.rows == [(True, 1), (True, 1), (False, 4), (False, 4)]


def test_a_first_row_without_a_trained_target_leaves_the_sanity_batch_whole():
    batch = {"input_ids": torch.ones(3, 5, dtype=torch.long), "labels": torch.full((3, 5), -100),
             "position_ids": torch.arange(5).repeat(3, 1)}
    batch["labels"][1:, 2] = 4
    row = lit_speed.head_batch(batch, 1)
    assert {k: tuple(v.shape) for k, v in row.items()} == {k: (1, 5) for k in batch}
    assert not bool((row["labels"] != -100).any())  # validation_step keeps the whole batch for this one
    assert [t.shape for t in lit_speed.head_batch((torch.zeros(3, 5), torch.zeros(3, 5)), 1)] == [(1, 5), (1, 5)]
