"""Will a Hugging Face fine-tune that trains on a GPU fit? The host's RAM and, on one GPU, the device's memory.

A GPU run holds its weights in the host's RAM while they load and, at the end of fit, again (Lightning's
``Strategy.teardown`` moves the module and the optimizer state to the CPU, and the export writes from there):
:func:`gpu_run_host_bytes`. Its step lives on the GPU: :func:`gpu_step_bytes` predicts it with the same CPU probe as
:mod:`~lit_speed.run.memory_fit.fit_check` (the run's precision under CPU autocast, eager);
:mod:`~lit_speed.run.memory_fit.fit_gate` refuses, before the weights load, a run that will not fit either, naming
what would.
"""
from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from lit_speed.run.memory_fit import fit_check, fit_levers
from lit_speed.strategies.config_facts import config_facts


def trains_on_gpu(cfg: DictConfig) -> bool:
    """Whether the run's step runs on a GPU (``trainer=gpu``, or ``accelerator: auto`` where CUDA is)."""
    accelerator = str(OmegaConf.select(cfg, "trainer.accelerator", default="cpu")).lower()
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


def gpu_run_host_bytes(cfg: DictConfig, facts: fit_check.RunFacts, levers: fit_levers.Levers) -> tuple[int, int]:
    """What a GPU run holds in the host's RAM beyond the process: ``(load, end)``. ``load``: the weights while
    ``from_pretrained`` reads them (then they move to the GPU); ``end``: Lightning's ``Strategy.teardown`` moves the
    module and the optimizer's state back to the CPU before ``on_fit_end`` (measured on an H200, 0.5B full
    fine-tuning: +6 GB of host RSS in the run's last seconds), and the export writes from there."""
    weights = facts.frozen * fit_check.frozen_bytes(facts, levers) + facts.trainable * fit_check.FLOAT32_BYTES
    state = int(facts.trainable * fit_check.optimizer_bytes_per_param(facts, levers, []))
    return fit_check.read_bytes(facts, levers), weights + state + fit_check.export_bytes(cfg, facts, levers)


#: The GPU memory a step holds over the tensors the probe counts (weights, optimizer state, the step's own
#: tensors): the CUDA caching allocator's rounding and the kernels' workspaces (cuBLAS, cuDNN attention). On an
#: H200 the eager rows' measured ``max_memory_allocated`` was 1.01-1.02x the probe's tensors (0.5B dims, LoRA, full,
#: full without the chunked loss; ``benchmarks/bench_gpu_fit_check.py``); the allocator's reserved memory was not
#: measured, so the check keeps 10% for it.
GPU_SLACK = 1.10


def gpu_to_judge(cfg: DictConfig) -> int | None:
    """The CUDA device index a run's step is judged on, from the config, or None where the GPU side is not judged:
    more than one process (DDP and ZeRO hold the state per rank differently), or a strategy other than ``auto``."""
    if not trains_on_gpu(cfg):
        return None
    strategy = config_facts(cfg).strategy
    if strategy.built or strategy.name != "auto":
        return None
    devices = OmegaConf.select(cfg, "trainer.devices", default=1)
    nodes = OmegaConf.select(cfg, "trainer.num_nodes", default=1)
    if isinstance(devices, (list, ListConfig)):
        return int(devices[0]) if len(devices) == 1 and int(nodes or 1) == 1 else None
    single = str(devices) == "1" or (str(devices) == "auto" and torch.cuda.device_count() <= 1)
    return 0 if single and int(nodes or 1) == 1 else None


def gpu_step_bytes(estimate: Any) -> int:
    """The GPU memory of a run's step from the CPU probe's estimate (:func:`estimate_run` with no process): weights,
    optimizer state and the larger of the step's tensors and the optimizer step's, times :data:`GPU_SLACK`. The
    probe runs eager under CPU autocast in the run's precision: a compiled step holds less (the H200 rows: LoRA 4.61
    vs 5.38 GiB of step tensors compiled/eager), so the prediction is the eager step's."""
    return int(estimate.tensors * GPU_SLACK)
