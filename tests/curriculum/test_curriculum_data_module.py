"""CurriculumDataModule through a real Trainer: allowed sets, mid-epoch resume, sequence-length warm-up."""
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import TensorDataset

from lit_speed.curriculum import CurriculumDataModule

N, BS, PACE = 60, 6, 15  # 10 batches per epoch; the curriculum widens over the first 15 batches


class IndexRecorder(pl.LightningModule):
    """A tiny regression model whose batches carry their dataset indices, recorded at every training step."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.seen: list[list[int]] = []
        self.lengths: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        self.seen.append(idx.tolist())
        self.lengths.append(x.shape[1])
        return torch.nn.functional.mse_loss(self.layer(x[:, :3].float()).squeeze(-1), y)

    def validation_step(self, batch, batch_idx):
        x, y, idx = batch
        self.log("val/loss", torch.nn.functional.mse_loss(self.layer(x[:, :3].float()).squeeze(-1), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _data(n=N, width=3):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, width, generator=g), torch.randn(n, generator=g), torch.arange(n))


def _dm(**kwargs):
    kwargs.setdefault("difficulty", torch.arange(N, dtype=torch.float))  # sample i has difficulty i
    return CurriculumDataModule(train_dataset=_data(), val_dataset=_data(12), batch_size=BS, pacing="linear",
                                start_fraction=0.25, pace_duration=PACE, seed=3, **kwargs)


def _trainer(tmp_path, max_steps, callbacks=(), **kwargs):
    return pl.Trainer(max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, callbacks=list(callbacks), default_root_dir=tmp_path,
                      enable_checkpointing=bool(callbacks), **kwargs)


def test_every_training_batch_is_within_the_allowed_set(tmp_path):
    model, dm = IndexRecorder(), _dm()
    _trainer(tmp_path, 25).fit(model, datamodule=dm)
    assert len(model.seen) == 25
    for g, batch in enumerate(model.seen):
        assert max(batch) < dm.sampler.n_allowed(g)
    assert dm.sampler.n_allowed(PACE - 1) < N == dm.sampler.n_allowed(PACE)
    assert max(model.seen[0]) < 15  # 25% of 60 at the first batch
    assert not dm.is_widening


@pytest.mark.parametrize("save_step", [13, 10])  # mid-epoch, and exactly at an epoch end
def test_resume_reproduces_the_uninterrupted_batches(tmp_path, save_step):
    total = 27
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=save_step, save_top_k=-1,
                           filename="{step}", save_last=False)
    straight = IndexRecorder()
    _trainer(tmp_path, total, [ckpt]).fit(straight, datamodule=_dm())
    resumed = IndexRecorder()
    path = tmp_path / "ckpt" / f"step={save_step}.ckpt"
    _trainer(tmp_path / "b", total).fit(resumed, datamodule=_dm(), ckpt_path=path)
    assert resumed.seen == straight.seen[save_step:]
    assert torch.load(path, weights_only=False)["CurriculumDataModule"]["batches_total"] == save_step


def test_resume_refuses_a_different_training_set(tmp_path):
    dm = _dm()
    dm.setup()
    with pytest.raises(ValueError, match="curriculum was over 99 training samples, this data has 60"):
        dm.load_state_dict({"train_size": 99, "epoch": 0, "batch_in_epoch": 0, "batches_total": 0})


def test_sequence_length_warmup_truncates_training_batches(tmp_path):
    model = IndexRecorder()
    dm = CurriculumDataModule(train_dataset=_data(width=32), val_dataset=_data(12, 32), batch_size=BS,
                              pacing="none", seq_len_start=8, seq_len_warmup=12, seq_len_multiple=8)
    _trainer(tmp_path, 14).fit(model, datamodule=dm)
    expected = [8] * 4 + [16] * 4 + [24] * 4 + [32] * 2  # 8 + 24 * g / 12 rounded down to a multiple of 8, then full
    assert model.lengths == expected
    assert not dm.is_widening


def test_batch_transform_applies_to_training_batches_only(tmp_path):
    calls = []

    def transform(batch):
        calls.append(len(batch[0]))
        return batch

    dm = _dm(batch_transform=transform)
    trainer = pl.Trainer(max_steps=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, limit_val_batches=1, val_check_interval=3,
                         num_sanity_val_steps=1, default_root_dir=tmp_path)
    trainer.fit(IndexRecorder(), datamodule=dm)
    assert calls == [BS] * 3  # neither the sanity check nor the validation batch went through it


def test_construction_errors_teach():
    with pytest.raises(ValueError, match="needs exactly one data source"):
        CurriculumDataModule(batch_size=4)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        CurriculumDataModule(train_dataset=_data())
    with pytest.raises(ValueError, match=r"pacing='linear' widens over pace_duration steps, got pace_duration=0"):
        CurriculumDataModule(train_dataset=_data(), batch_size=4, pacing="linear")
    with pytest.raises(ValueError, match=r"pace_unit must be one of \('steps', 'epochs'\), got 'hours'"):
        CurriculumDataModule(train_dataset=_data(), batch_size=4, pace_duration=3, pace_unit="hours")
    with pytest.raises(ValueError, match="seq_len_start=8 needs seq_len_warmup > 0"):
        CurriculumDataModule(train_dataset=_data(), batch_size=4, pacing="none", seq_len_start=8)
    with pytest.raises(ValueError, match="need num_workers > 0"):
        CurriculumDataModule(train_dataset=_data(), batch_size=4, pacing="none", persistent_workers=True)


def test_epoch_pacing_unit_counts_full_data_epochs():
    dm = _dm(pace_unit="epochs")  # pace_duration=15 epochs of 10 batches
    dm.setup()
    assert dm.pace_batches == 150
    assert dm.fraction_at(75) == pytest.approx(0.25 + 0.75 * 0.5)


def test_lightning_leaves_the_curriculum_sampler_in_place_under_ddp():
    """Private Lightning 2.6.6 internal: ``_DataConnector._requires_distributed_sampler`` skips loaders whose
    sampler is a ``DistributedSampler``. If Lightning changes this, it would wrap our sampler and shard it again."""
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)
    dm = _dm()
    dm.setup()
    plain = torch.utils.data.DataLoader(_data(), batch_size=BS, shuffle=True)
    assert trainer._data_connector._requires_distributed_sampler(plain)  # the control: a plain loader is wrapped
    assert not trainer._data_connector._requires_distributed_sampler(dm.train_dataloader())
