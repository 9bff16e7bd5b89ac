"""Fail loudly when Lightning or DeepSpeed change a private detail ZeroStrategy relies on.

Each test names the helper in ``lit_speed/strategies/_lightning_compat.py`` (written against Lightning 2.6.6,
DeepSpeed 0.19.8) that must be revisited when it fails.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import os

import lightning
import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from lightning.pytorch.loops.fit_loop import _FitLoop  # noqa: E402
from lightning.pytorch.strategies import DeepSpeedStrategy, Strategy  # noqa: E402

from lit_speed.strategies import _lightning_compat as compat  # noqa: E402


def test_lightning_version_is_the_one_the_helpers_were_written_for() -> None:
    major_minor = ".".join(lightning.__version__.split(".")[:2])
    assert major_minor == ".".join(compat.LIGHTNING_VERSION.split(".")[:2]), (
        f"Lightning {lightning.__version__} installed; _lightning_compat.py was written against "
        f"{compat.LIGHTNING_VERSION}: re-check every helper in it, then update LIGHTNING_VERSION")


def test_should_accumulate_helper_target_exists() -> None:
    assert callable(getattr(_FitLoop, "_should_accumulate", None)), "should_accumulate(): fit_loop._should_accumulate gone"


def test_init_deepspeed_distributed_helper_target_exists() -> None:
    source = inspect.getsource(DeepSpeedStrategy._init_deepspeed_distributed)
    assert "deepspeed.init_distributed" in source, "init_deepspeed_distributed(): Lightning changed the method"


def test_lightning_still_passes_the_device_index_as_device_rank() -> None:
    # intercept_deepspeed_initialize()/with_device_rank() amend exactly this call
    for method in (DeepSpeedStrategy._setup_model_and_optimizer, DeepSpeedStrategy._initialize_deepspeed_inference):
        source = inspect.getsource(method)
        assert "deepspeed.initialize(" in source and "device_rank=self.root_device.index" in source, method
        assert "import deepspeed" in source, "the patch relies on a function-local `import deepspeed`"


def test_lightning_still_checks_cuda_in_setup_environment() -> None:
    # ZeroStrategy.setup_environment skips DeepSpeedStrategy's body by calling DDPStrategy's
    source = inspect.getsource(DeepSpeedStrategy.setup_environment)
    assert "CUDAAccelerator" in source and "super().setup_environment()" in source


def test_precision_plugin_is_a_property_with_a_setter() -> None:
    prop = inspect.getattr_static(Strategy, "precision_plugin")
    assert isinstance(prop, property) and prop.fset is not None


def test_shm_patch_reaches_the_module_deepspeed_calls() -> None:
    module = importlib.import_module("deepspeed.comm.torch")
    assert "build_shm_op()" in inspect.getsource(module.TorchBackend.__init__), "skip_shm_comm_build(): target moved"
    original = module.build_shm_op
    try:
        compat.skip_shm_comm_build()
        assert module.build_shm_op() is None
    finally:
        module.build_shm_op = original


def test_intercept_amends_device_rank_and_restores_deepspeed_initialize() -> None:
    import deepspeed

    original = deepspeed.initialize
    seen = {}

    def adjust(kwargs):
        seen.update(compat.with_device_rank(kwargs, 3))
        raise RuntimeError("stop before the engine is built")

    with compat.intercept_deepspeed_initialize(adjust), pytest.raises(RuntimeError, match="stop before"):
        deepspeed.initialize(args=argparse.Namespace(device_rank=None), config={})
    assert seen["args"].device_rank == 3
    assert deepspeed.initialize is original
    kept = compat.with_device_rank({"args": argparse.Namespace(device_rank=0)}, 3)
    assert kept["args"].device_rank == 0  # a real device index (CUDA) is left alone


def test_auto_micro_batch_size_replaces_lightnings_private_hook() -> None:
    source = inspect.getsource(DeepSpeedStrategy._format_batch_size_and_grad_accum_config)
    assert "self._auto_select_batch_size()" in source, "ZeroStrategy._auto_select_batch_size is no longer called"
    assert "fit_loop._data_source" in inspect.getsource(DeepSpeedStrategy._auto_select_batch_size)
