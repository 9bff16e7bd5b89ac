"""Fixtures and hooks shared by every test: the real Hydra config from conf/, shrunk, with outputs in tmp_path.

``tests/`` is a package, so pytest (rootdir import, ``prepend`` mode) puts the repository root first on
``sys.path``: ``lit_speed`` and ``tests.helpers`` import from this checkout, not from wherever it is installed.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from tests.helpers.repo import ROOT, compose_config


def pytest_configure(config: pytest.Config) -> None:
    """Set the environment every run needs, before any test module is collected (many import DeepSpeed)."""
    from lit_speed.strategies.ds_accelerator import default_accelerator_name  # imports torch, not DeepSpeed

    os.environ.setdefault("LIT_SPEED_ROOT", str(ROOT))
    # precision=auto caches its step timings on disk: tests (and their subprocesses) use a cache of their own
    os.environ["LIT_SPEED_CACHE_DIR"] = tempfile.mkdtemp(prefix="lit_speed_test_cache_")
    # DeepSpeed's accelerator follows this machine, so `pytest -m gpu` on a GPU runs DeepSpeed's CUDA
    # accelerator. ZeroStrategy re-checks the choice at setup.
    os.environ["DS_ACCELERATOR"] = default_accelerator_name()


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove the run's own timing cache."""
    cache = os.environ.get("LIT_SPEED_CACHE_DIR", "")
    if os.path.basename(cache).startswith("lit_speed_test_cache_"):
        shutil.rmtree(cache, ignore_errors=True)


@pytest.fixture
def make_cfg(tmp_path):
    """``make_cfg(["data=charlm", ...])`` -> a composed config writing into ``tmp_path``."""

    def _make(overrides: list[str] | None = None) -> DictConfig:
        return compose_config(list(overrides or []), tmp_path)

    yield _make
    GlobalHydra.instance().clear()


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
