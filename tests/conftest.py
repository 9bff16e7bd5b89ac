"""Shared fixtures: compose the real Hydra config from conf/, shrunk, with outputs in tmp_path."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
os.environ.setdefault("LIT_SPEED_ROOT", str(ROOT))
# precision=auto caches its step timings on disk: tests (and their subprocesses) use a cache of their own
os.environ["LIT_SPEED_CACHE_DIR"] = tempfile.mkdtemp(prefix="lit_speed_test_cache_")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from lit_speed.strategies.ds_accelerator import default_accelerator_name  # noqa: E402 - imports torch, not DeepSpeed

# Before any test module imports DeepSpeed (many do at collection): its accelerator follows this machine, so
# `pytest -m gpu` on a GPU runs DeepSpeed's CUDA accelerator. ZeroStrategy re-checks the choice at setup.
os.environ["DS_ACCELERATOR"] = default_accelerator_name()


def compose_config(overrides: list[str], output_dir: Path) -> DictConfig:
    """The config ``scripts/train.py <overrides>`` would run, writing into ``output_dir``."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(output_dir)
        cfg.hydra.job.num = 0
    HydraConfig().set_config(cfg)  # lets ${hydra:runtime.output_dir} resolve outside @hydra.main
    with open_dict(cfg):
        cfg.paths.output_dir = str(output_dir)
        cfg.paths.log_dir = str(output_dir / "logs")
        del cfg.hydra
    return cfg


@pytest.fixture
def make_cfg(tmp_path):
    """``make_cfg(["data=charlm", ...])`` -> a composed config writing into ``tmp_path``."""

    def _make(overrides: list[str] | None = None) -> DictConfig:
        return compose_config(list(overrides or []), tmp_path)

    yield _make
    GlobalHydra.instance().clear()


def run_train_script(args: list[str], cwd: Path | None = None, timeout: float = 300, env: dict | None = None):
    """Run ``scripts/train.py`` in a fresh interpreter; returns the CompletedProcess (text)."""
    import subprocess

    full_env = {**os.environ, "HYDRA_FULL_ERROR": "0", **(env or {})}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), *args], cwd=cwd or ROOT,
                          capture_output=True, text=True, timeout=timeout, env=full_env)


_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE",
             "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED", "PL_SEED_WORKERS")


@pytest.fixture(autouse=True)
def _isolated_distributed_env():
    """An in-process fit leaves MASTER_PORT & co. in os.environ; a later multi-process test would inherit them and
    fail with "address already in use". Each test starts with the environment the session started with."""
    saved = {key: os.environ.get(key) for key in _DIST_ENV}
    for key in _DIST_ENV:
        os.environ.pop(key, None)
    yield
    for key in _DIST_ENV:
        os.environ.pop(key, None)
        if saved[key] is not None:
            os.environ[key] = saved[key]
