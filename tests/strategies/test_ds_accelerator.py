"""DeepSpeed's accelerator follows the device a run trains on, chosen at strategy setup, not at import.

Each case runs in a fresh interpreter: DeepSpeed caches its accelerator for the life of a process, and the
point is the import order (DeepSpeed imported, and its accelerator fixed, before the strategy is set up).
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.zero import clean_env

ROOT = Path(__file__).resolve().parents[2]

# DeepSpeed imported with DS_ACCELERATOR=cuda (as on a GPU box), then a ZeRO-2 run on the CPU.
CUDA_AT_IMPORT_CPU_RUN = """
import json
from deepspeed.accelerator import get_accelerator
from lit_speed.run.process_end import end_distributed_process
from lit_speed.strategies.zero_strategy import ZeroStrategy
from tests.helpers.zero import make_run, make_trainer
at_import = get_accelerator().device_name()
dm, model = make_run({cache!r})
trainer = make_trainer(ZeroStrategy(stage=2), max_steps=2)
trainer.fit(model, dm)
print(json.dumps({{"at_import": at_import, "at_end": get_accelerator().device_name(), "losses": model.losses}}))
end_distributed_process()  # a script's last call after a run with a group (gloo's abort at finalization)
"""

# DeepSpeed imported with DS_ACCELERATOR=cpu (as tests/conftest.py and scripts do on CPU machines), then a
# ZeroStrategy set up for a CUDA device. No CUDA device here: the setup stops at torch.cuda.set_device, after
# the accelerator choice this test checks.
CPU_AT_IMPORT_CUDA_SETUP = """
import json, os
import torch
from deepspeed.accelerator import get_accelerator
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.plugins.precision import DeepSpeedPrecision
from lit_speed.strategies.zero_strategy import ZeroStrategy
at_import = get_accelerator().device_name()
strategy = ZeroStrategy(stage=2, accelerator=CUDAAccelerator(), parallel_devices=[torch.device("cuda", 0)],
                        precision_plugin=DeepSpeedPrecision("32-true"))
try:
    strategy.setup_environment()
    error = None
except Exception as exc:  # no CUDA device on this machine: set_device fails after the choice
    error = type(exc).__name__
import deepspeed.runtime.utils as ds_utils
print(json.dumps({{"at_import": at_import, "at_setup": get_accelerator().device_name(),
                   "class": type(get_accelerator()).__name__, "env": os.environ["DS_ACCELERATOR"],
                   "utils_bound": ds_utils.torch_memory_reserved.__self__ is get_accelerator(),
                   "error": error}}))
"""


def _run(script: str, ds_accelerator: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=600, env=clean_env(DS_ACCELERATOR=ds_accelerator), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cpu_run_switches_deepspeed_from_the_cuda_accelerator_fixed_at_import(tmp_path: Path) -> None:
    out = _run(CUDA_AT_IMPORT_CPU_RUN.format(cache=str(tmp_path)),
               "cuda")
    assert out["at_import"] == "cuda"  # the problematic order really happened
    assert out["at_end"] == "cpu"
    assert len(out["losses"]) == 2 and all(loss == loss for loss in out["losses"])  # trained, finite


def test_cuda_setup_switches_deepspeed_from_the_cpu_accelerator_fixed_at_import() -> None:
    out = _run(CPU_AT_IMPORT_CUDA_SETUP.format(), "cpu")
    assert out["at_import"] == "cpu"
    assert (out["at_setup"], out["class"], out["env"]) == ("cuda", "CUDA_Accelerator", "cuda")
    assert out["utils_bound"]  # DeepSpeed's import-time memory readers follow the switch too


def test_unknown_accelerator_name_is_refused() -> None:
    from lit_speed.strategies.ds_accelerator import use_deepspeed_accelerator

    with pytest.raises(ValueError, match=r"DeepSpeed accelerator must be one of \('cpu', 'cuda'\), got 'xpu'"):
        use_deepspeed_accelerator("xpu")


def test_default_name_follows_torch() -> None:
    import torch

    from lit_speed.strategies.ds_accelerator import default_accelerator_name

    assert default_accelerator_name() == ("cuda" if torch.cuda.is_available() else "cpu")
