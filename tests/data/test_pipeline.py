"""Data-pipeline options: whole-batch fetching keeps the same batches, loader options, vectorised transforms."""
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lit_speed
from lit_speed.data.charlm import CharLMDataModule, TokenWindows
from lit_speed.data.digits import DigitsDataModule
from lit_speed.data.pipeline import (
    BatchFetch,
    check_worker_options,
    jitter_images,
    loader_kwargs,
    preload,
    resolve_num_workers,
    resolve_pin_memory,
    truncate_sequences,
)


def _batches(loader, n=5, seed=0):
    torch.manual_seed(seed)
    return [b for _, b in zip(range(n), loader)]


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for u, v in zip(x, y):
            assert torch.equal(u, v)


def test_digits_preload_serves_the_same_batches_as_per_sample_loading():
    fast, plain = DigitsDataModule(batch_size=32, preload=True), DigitsDataModule(batch_size=32, preload=False)
    fast.setup(), plain.setup()
    _assert_same(_batches(fast.train_dataloader()), _batches(plain.train_dataloader()))


@pytest.fixture(scope="module")
def small_charlm(tmp_path_factory):
    root = Path(lit_speed.__file__).parent  # a few dozen .py files: a tiny offline corpus
    return dict(cache_dir=str(tmp_path_factory.mktemp("charlm")), root=str(root), max_bytes=60_000, val_every=3,
                block_size=16, batch_size=4)


@pytest.mark.parametrize("preloaded", [False, True])
def test_charlm_batched_gather_matches_the_plain_shuffled_loader(small_charlm, preloaded):
    dm = CharLMDataModule(**small_charlm, preload=preloaded)
    dm.setup()
    plain = DataLoader(dm.train_dataset, batch_size=4, shuffle=True, drop_last=True)  # the original loader
    _assert_same(_batches(dm.train_dataloader()), _batches(plain))
    assert isinstance(dm.train_dataset.tokens, torch.Tensor) == preloaded


def test_token_windows_get_batch_equals_stacked_items():
    tokens = torch.arange(100, dtype=torch.uint8)
    for data in (tokens, tokens.numpy()):
        ds = TokenWindows(data, block_size=5, stride=3)
        x, y = ds.get_batch([0, 4, 7])
        assert torch.equal(x, torch.stack([ds[i][0] for i in (0, 4, 7)]))
        assert torch.equal(y, torch.stack([ds[i][1] for i in (0, 4, 7)]))


def test_batch_fetch_and_preload_fall_back_to_collate():
    samples = [(torch.full((2,), float(i)), i) for i in range(6)]
    fetched = BatchFetch(samples)[[1, 3]]
    assert torch.equal(fetched[0], torch.tensor([[1.0, 1.0], [3.0, 3.0]])) and fetched[1].tolist() == [1, 3]
    table = preload(samples)
    assert isinstance(table, TensorDataset) and torch.equal(table[[2, 5]][1], torch.tensor([2, 5]))


def test_loader_options_resolve_and_refuse_bad_values():
    assert resolve_num_workers("auto", preloaded=True) == 0
    assert 0 <= resolve_num_workers("auto", preloaded=False) <= 8
    assert resolve_pin_memory("auto", None) is False  # no CUDA trainer: pinning would only cost time
    with pytest.raises(ValueError, match=r"num_workers must be 'auto' or an int >= 0, got -1"):
        resolve_num_workers(-1, preloaded=False)
    with pytest.raises(ValueError, match="pin_memory must be 'auto', True or False, got 'yes'"):
        resolve_pin_memory("yes")
    with pytest.raises(ValueError, match=r"need num_workers > 0.*set num_workers"):
        check_worker_options(0, True, None)
    with pytest.raises(ValueError, match="prefetch_factor must be >= 1 or None, got 0"):
        check_worker_options(2, False, 0)
    check_worker_options("auto", True, 2)  # auto may resolve to 0 workers: the options are then dropped
    assert loader_kwargs(0, False, True, 2) == {"num_workers": 0, "pin_memory": False, "persistent_workers": False}
    with pytest.raises(ValueError, match="need num_workers > 0"):
        DigitsDataModule(prefetch_factor=2)
    with pytest.raises(ValueError, match="need num_workers > 0"):
        CharLMDataModule(cache_dir="unused", persistent_workers=True)


def test_digits_worker_options_reach_the_loader():
    dm = DigitsDataModule(batch_size=16, num_workers=1, persistent_workers=True, prefetch_factor=3)
    dm.setup()
    loader = dm.train_dataloader()
    assert (loader.num_workers, loader.persistent_workers, loader.prefetch_factor) == (1, True, 3)


def shift_one(image: torch.Tensor, dr: int, dc: int, side: int = 8, pad: int = 1) -> torch.Tensor:
    """Per-sample reference: zero-pad a flat ``side x side`` image and crop it at offset (dr, dc)."""
    img = torch.nn.functional.pad(image.view(side, side), (pad,) * 4)
    return img[dr:dr + side, dc:dc + side].reshape(-1)


def test_vectorised_jitter_equals_the_per_sample_shift():
    x, y = torch.rand(32, 64), torch.arange(32)
    out, labels = jitter_images((x, y), noise=0.0, generator=torch.Generator().manual_seed(1))
    shifts = torch.randint(0, 3, (32, 2), generator=torch.Generator().manual_seed(1))  # the same draw
    expected = torch.stack([shift_one(x[i], int(shifts[i, 0]), int(shifts[i, 1])) for i in range(32)])
    assert torch.equal(out, expected) and torch.equal(labels, y)
    assert not torch.equal(out, x)  # some images moved


def test_truncate_sequences_cuts_only_time_axes():
    batch = {"x": torch.zeros(2, 10), "y": (torch.zeros(2, 10, 3), torch.zeros(2))}
    out = truncate_sequences(batch, 4)
    assert out["x"].shape == (2, 4) and out["y"][0].shape == (2, 4, 3) and out["y"][1].shape == (2,)


def test_a_batch_transform_that_is_not_a_function_is_refused_naming_the_module():
    from lit_speed.data.pipeline import check_batch_transform

    assert check_batch_transform("X", None) is None and check_batch_transform("X", jitter_images) is jitter_images
    with pytest.raises(ValueError, match=r"DigitsDataModule\(batch_transform='foo'\): must be a function batch -> "
                                         r"batch or None, got a str\. Fix: "):
        DigitsDataModule(batch_transform="foo")
    with pytest.raises(ValueError, match=r"CharLMDataModule\(batch_transform=3\)"):
        CharLMDataModule(cache_dir=".", batch_transform=3)


def test_a_mid_epoch_resume_of_a_lit_speed_loader_gets_no_not_resumable_warning(tmp_path):
    # the order resumes through the DataModule's state (test_faults_midepoch.py); Lightning asked the loader only
    import functools
    import warnings

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_speed.data.pipeline import ResumableDataLoader
    from lit_speed.models.mlp import MLPClassifier

    def fit(max_steps: int, ckpt_path: str | None = None) -> None:
        trainer = pl.Trainer(accelerator="cpu", max_steps=max_steps, limit_val_batches=0, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                             callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_last=True)])
        model = MLPClassifier(optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
        trainer.fit(model, DigitsDataModule(batch_size=64), ckpt_path=ckpt_path)
        assert isinstance(trainer.train_dataloader, ResumableDataLoader)

    fit(3)  # 23 batches per epoch: step 3 is mid-epoch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(5, str(tmp_path / "last.ckpt"))
    assert not [str(w.message) for w in caught if "not resumable" in str(w.message)]
