"""A checkpoint written at an epoch's *last* training batch (``every_n_train_steps`` landing there) resumes bitwise.

Lightning 2.6 counts that epoch as done on resume and goes on with an iterator it built right after the restore,
before the next epoch's ``set_epoch``; FaultTolerance then rewound the RNG to the checkpoint's state, so the
uninterrupted run's draws for the next epoch (loader seed, shuffle, dropout) were replayed twice: 24 of 24
tensors differed in the generated resume matrix (``accumulation=fixed``, and the default with a kill at step 9).
"""
from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lit_speed.checkpointing import FaultTolerance

BATCHES, EPOCHS = 4, 3


class DropoutNet(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                       torch.nn.Linear(16, 1))
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append(x.clone())
        return torch.nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(BATCHES * 8, 6, generator=gen), torch.randn(BATCHES * 8, 1, generator=gen))
        return DataLoader(data, batch_size=8, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(root, max_epochs, ckpt_path=None, restore_rng=True):
    pl.seed_everything(0)
    model = DropoutNet()
    trainer = pl.Trainer(max_epochs=max_epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         deterministic=True, default_root_dir=root, callbacks=[
                             ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=BATCHES, save_last=True),
                             FaultTolerance(restore_rng=restore_rng)])
    trainer.fit(model, ckpt_path=ckpt_path)
    return model


@pytest.mark.parametrize("restore_rng", [True, False], ids=["rng-saved", "control-rng-not-saved"])
def test_checkpoint_at_an_epochs_last_batch_resumes_bitwise(tmp_path, restore_rng):
    reference = _fit(tmp_path / "reference", EPOCHS)
    _fit(tmp_path / "run", 1, restore_rng=restore_rng)  # stopped after epoch 1: last.ckpt from its last batch
    assert torch.load(tmp_path / "run" / "ckpt" / "last.ckpt", weights_only=False)["global_step"] == BATCHES
    resumed = _fit(tmp_path / "run", EPOCHS, ckpt_path=str(tmp_path / "run" / "ckpt" / "last.ckpt"),
                   restore_rng=restore_rng)
    equal = [torch.equal(a, b) for a, b in zip(resumed.seen, reference.seen[BATCHES:])]
    same_weights = all(torch.equal(a, b) for a, b in zip(reference.parameters(), resumed.parameters()))
    assert len(resumed.seen) == (EPOCHS - 1) * BATCHES
    if restore_rng:
        assert all(equal) and same_weights, f"{sum(equal)}/{len(equal)} batches equal"
    else:  # the control: Lightning alone resumes this one differently (so the test above can fail)
        assert not (all(equal) and same_weights)
