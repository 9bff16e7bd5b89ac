"""Will a Hugging Face fine-tune that trains on a GPU fit? The host's RAM and, on one GPU, the device's memory.

A GPU run holds its weights in the host's RAM while they load and, at the end of fit, again (Lightning's
``Strategy.teardown`` moves the module and the optimizer state to the CPU, and the export writes from there):
:func:`gpu_run_host_bytes`. Its step lives on the GPU: :func:`gpu_step_bytes` predicts it with the same CPU probe as
:mod:`lit_speed.run.fit_check` (the run's precision under CPU autocast, eager) and :func:`check_gpu_run` refuses,
before the weights load, a run that will not fit either, naming what would.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from lit_speed.run import fit_check
from lit_speed.run.config_error import ConfigError


def trains_on_gpu(cfg: DictConfig) -> bool:
    """Whether the run's step runs on a GPU (``trainer=gpu``, or ``accelerator: auto`` where CUDA is)."""
    accelerator = str(OmegaConf.select(cfg, "trainer.accelerator", default="cpu")).lower()
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


def gpu_run_host_bytes(cfg: DictConfig, facts: fit_check.RunFacts, levers: fit_check.Levers) -> tuple[int, int]:
    """What a GPU run holds in the host's RAM beyond the process: ``(load, end)``. ``load``: the weights while
    ``from_pretrained`` reads them (then they move to the GPU); ``end``: Lightning's ``Strategy.teardown`` moves the
    module and the optimizer's state back to the CPU before ``on_fit_end`` (measured on an H200, 0.5B full
    fine-tuning: +6 GB of host RSS in the run's last seconds), and the export writes from there."""
    weights = facts.frozen * fit_check.frozen_bytes(facts, levers) + facts.trainable * 4
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
    strategy = cfg.get("strategy")
    name = str(strategy.get("name", "auto")) if isinstance(strategy, DictConfig) else str(strategy or "auto")
    if fit_check.target_of(strategy) or name != "auto":
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
    return int((estimate.weights + estimate.optimizer + max(estimate.step, estimate.optimizer_step)) * GPU_SLACK)


def _check_fits_gpu(cfg: DictConfig, facts: fit_check.RunFacts, configured: fit_check.Levers, device: int,
                    free_bytes: int | None) -> None:
    """Refuse a single-GPU run whose step will not fit in the device's free memory, naming the cheapest lever set
    that fits there (the same search as the RAM check's)."""
    from lit_speed.memory.rss_estimate import gib

    free = torch.cuda.mem_get_info(device)[0] if free_bytes is None else free_bytes
    if fit_check.generous_bound(facts, 0) <= free:
        return  # fits even counted generously: no probe
    cache: dict = {}
    try:
        estimate = fit_check.estimate_run(cfg, configured, 0, facts, cache=cache)
    except Exception as error:  # noqa: BLE001 - a probe that cannot run must not stop a run it cannot judge
        warnings.warn(f"lit_speed.run.fit_check: the GPU memory estimate could not run ({type(error).__name__}: "
                      f"{error}); the run goes on unchecked", stacklevel=3)
        return
    need = gpu_step_bytes(estimate)
    if need <= free:
        return
    what = (f"this run's step needs about {gib(need)} of GPU memory (weights {gib(estimate.weights)}, optimizer "
            f"{gib(estimate.optimizer)}, step {gib(max(estimate.step, estimate.optimizer_step))}; predicted eager, "
            f"x{GPU_SLACK:.2f} for the allocator), cuda:{device} has {gib(free)} free")
    callbacks = list(fit_check.callback_nodes(cfg))
    for levers in fit_check.lever_sets(configured, not configured.lora)[1:]:
        other = gpu_step_bytes(fit_check.estimate_run(cfg, levers, 0, cache=cache))
        if other <= free:
            raise ConfigError(f"{what}. Fix: {' '.join(levers.overrides(configured, callbacks))} (predicted "
                              f"{gib(other)}); scripts/plan.py shows the parts")
    raise ConfigError(f"{what}, and no lever set fits (chunked loss, a bf16 base, 8-bit states, checkpointing, LoRA, "
                      "micro-batch 1). Fix: a smaller model, data.block_size, a GPU with more memory, or "
                      "strategy=zero3_offload")


def check_gpu_run(cfg: DictConfig, facts: fit_check.RunFacts, configured: fit_check.Levers, process: int,
                  budget: int, gpu_free_bytes: int | None = None) -> None:
    """:func:`lit_speed.run.fit_gate.check_fits_memory` for a run that trains on a GPU: the host side against
    ``budget`` (the process's RSS + the RAM available), then, for one process on one GPU, the step against the
    device's free memory (``gpu_free_bytes`` stands in for ``torch.cuda.mem_get_info`` in tests)."""
    from lit_speed.memory.rss_estimate import gib

    load, end = gpu_run_host_bytes(cfg, facts, configured)
    peak = process + max(load, end)
    if peak > budget:
        raise ConfigError(f"this run trains on the GPU and needs about {gib(peak)} of host RAM at its peak (loading "
                          f"the weights {gib(load)}; at the end of fit Lightning's teardown moves the weights and the "
                          f"optimizer state to the CPU, and the export writes from there: {gib(end)}), {gib(budget)} "
                          "is there. Fix: peft=lora (the adapters' optimizer state only), optimizer=adamw8bit, or a "
                          "machine with more RAM")
    device = gpu_to_judge(cfg)  # judged where the device's free memory can be read (or is given)
    if device is not None and (gpu_free_bytes is not None or torch.cuda.is_available()):
        _check_fits_gpu(cfg, facts, configured, device, gpu_free_bytes)
