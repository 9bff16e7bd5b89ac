"""ZeroStrategy on CUDA: the path Lightning's own DeepSpeedStrategy takes, plus fp16 from a scaler config."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (DeepSpeed's CUDA path)")]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_on_one_gpu_matches_ddp(tmp_path, stage: int) -> None:
    import lightning.pytorch as pl
    from deepspeed.accelerator import get_accelerator

    from lit_speed.strategies.zero_strategy import ZeroStrategy
    from tests.helpers.zero import make_run

    losses = {}
    for name, strategy in (("ddp", "ddp"), ("zero", ZeroStrategy(stage=stage))):
        dm, model = make_run(tmp_path / "cache")
        trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=strategy, max_steps=4, logger=False,
                             enable_checkpointing=False, limit_val_batches=0, use_distributed_sampler=False)
        trainer.fit(model, dm)
        losses[name] = model.losses
    # fp32 on both sides; cuBLAS may pick different kernels for the flat ZeRO buffers: 1e-4 relative
    assert losses["zero"] == pytest.approx(losses["ddp"], rel=1e-4)
    assert get_accelerator().device_name() == "cuda"


def test_pytest_runs_deepspeed_on_the_cuda_accelerator() -> None:
    """tests/conftest.py chose DS_ACCELERATOR from this machine before any test module imported DeepSpeed."""
    import os

    from deepspeed.accelerator import get_accelerator

    assert os.environ["DS_ACCELERATOR"] == "cuda"
    assert type(get_accelerator()).__name__ == "CUDA_Accelerator"


def test_fp16_on_gpu_takes_the_scaler_config(tmp_path) -> None:
    import lightning.pytorch as pl

    from lit_speed.strategies.zero_strategy import ZeroStrategy
    from tests.helpers.zero import make_run

    guarded = SimpleNamespace(precision="16-mixed", mode="mixed", on_nonfinite="skip",
                              scaler_config={"init_scale": 2.0 ** 10, "growth_interval": 100})
    strategy = ZeroStrategy(stage=2)
    dm, model = make_run(tmp_path / "cache")
    trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=strategy, max_steps=3, logger=False,
                         enable_checkpointing=False, limit_val_batches=0)
    strategy.precision_plugin = guarded
    trainer.fit(model, dm)
    assert trainer.strategy.config["fp16"]["initial_scale_power"] == 10
    assert trainer.strategy.deepspeed_engine.fp16_enabled()
