"""The checkout under test: its root, its Hydra config, and ``scripts/train.py`` run the way a user runs it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
#: The docs a user reads: the top README and one card per component package (``lit_speed/<component>/README.md``).
CARDS = sorted((ROOT / "lit_speed").glob("*/README.md"))
DOCS = [ROOT / "README.md", *CARDS]


def docs_text() -> str:
    """The README and every card, one after the other (each file's code fences are balanced)."""
    return "\n".join(path.read_text() for path in DOCS)


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


def run_train_script(args: list[str], cwd: Path | None = None, timeout: float = 300, env: dict | None = None):
    """Run ``scripts/train.py`` in a fresh interpreter; returns the CompletedProcess (text)."""
    full_env = {**os.environ, "HYDRA_FULL_ERROR": "0", **(env or {})}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), *args], cwd=cwd or ROOT,
                          capture_output=True, text=True, timeout=timeout, env=full_env)


def plan_script() -> ModuleType:
    """``scripts/plan.py`` as a module, for in-process calls of its ``main`` and ``plan_hf_run``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("plan_script", ROOT / "scripts" / "plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
