"""The refusal before the weights load: :func:`check_fits_memory`, what ``scripts/train.py`` runs for a Hugging Face
model folder. The predictions are :mod:`~lit_speed.run.memory_fit.fit_check`'s (the process's peak RSS of a CPU run)
and :mod:`~lit_speed.run.memory_fit.fit_check_gpu`'s (a GPU run's host side and its step on one GPU); both are judged
the same way: no probe where a generous bound fits, the configured levers' estimate, then the cheapest lever set that
fits."""
from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from omegaconf import DictConfig

from lit_speed.run.config_error import ConfigError
from lit_speed.run.memory_fit import fit_check, fit_check_gpu, fit_levers


def check_fits_memory(cfg: DictConfig, available_bytes: int | None = None, gpu_free_bytes: int | None = None) -> None:
    """Refuse, before the weights are read, a Hugging Face run whose predicted peak RSS exceeds the memory this
    machine has free, naming the cheapest lever set (:func:`~lit_speed.run.memory_fit.fit_levers.lever_sets`) that
    fits. A run on a GPU is judged by what it holds in the host's RAM and, on one GPU, by its step's GPU memory against
    the device's free memory (:mod:`~lit_speed.run.memory_fit.fit_check_gpu`; ``gpu_free_bytes`` stands in for
    ``torch.cuda.mem_get_info`` in tests)."""
    import psutil

    from lit_speed.memory.host_memory import host_memory
    from lit_speed.memory.rss_estimate import gib

    if fit_check.hf_folder(cfg) is None:
        return
    process = psutil.Process().memory_info().rss
    available = host_memory().available if available_bytes is None else available_bytes
    budget = process + available
    configured = fit_levers.configured_levers(cfg)
    # the meta-device model and the optimizer, built once
    facts = fit_check.run_facts(cfg, fit_check.hf_folder(cfg), configured)
    if fit_check_gpu.trains_on_gpu(cfg):
        _check_gpu_run(cfg, facts, configured, process, budget, gpu_free_bytes)
        return
    judged = _judge(cfg, facts, configured, process, budget, lambda estimate: estimate.peak,
                    "the memory estimate could not run ({}); the run goes on unchecked. scripts/plan.py shows the "
                    "estimate's parts")
    if judged is None:
        return
    estimate, fix = judged
    if fix is not None:
        overrides, other = fix
        raise ConfigError(f"this run needs about {gib(estimate.peak)} of RAM at its peak (lit_speed.memory."
                          f"rss_estimate: weights {gib(estimate.weights)}, optimizer {gib(estimate.optimizer)}, "
                          f"step {gib(max(estimate.step, estimate.optimizer_step))}), {gib(budget)} is there. "
                          f"Fix: {overrides} (predicted {gib(other)}); scripts/plan.py shows every option")
    raise ConfigError(f"this run needs about {gib(estimate.peak)} of RAM at its peak, {gib(budget)} is there, and no "
                      "lever set fits (chunked loss, a bf16 base, 8-bit states, checkpointing, LoRA, micro-batch 1). "
                      "Fix: a smaller model, data.block_size, or a machine with more memory")


def _judge(cfg: DictConfig, facts: fit_check.RunFacts, configured: fit_levers.Levers, process: int, budget: int,
           need: Callable[[Any], int], unchecked: str) -> tuple[Any, tuple[str, int] | None] | None:
    """None when the run fits (by the generous bound without a probe, or by the configured levers' estimate) or its
    probe cannot run (a warning: ``unchecked`` with the error); else the configured estimate and the cheapest lever
    set whose ``need`` fits in ``budget`` (``(overrides, its need)``, or None when none does)."""
    if fit_check.generous_bound(facts, process) <= budget:
        return None  # fits even counted generously: no probe
    cache: dict = {}
    try:
        estimate = fit_check.estimate_run(cfg, configured, process, facts, cache=cache)
    except Exception as error:  # noqa: BLE001 - a probe that cannot run must not stop a run it cannot judge
        warnings.warn("lit_speed.run.memory_fit.fit_check: " + unchecked.format(f"{type(error).__name__}: {error}"),
                      stacklevel=3)
        return None
    if need(estimate) <= budget:
        return None
    callbacks = list(fit_levers.callback_nodes(cfg))
    for levers in fit_levers.lever_sets(configured, not configured.lora)[1:]:
        other = need(fit_check.estimate_run(cfg, levers, process, cache=cache))
        if other <= budget:
            return estimate, (" ".join(levers.overrides(configured, callbacks)), other)
    return estimate, None


def _check_gpu_run(cfg: DictConfig, facts: fit_check.RunFacts, configured: fit_levers.Levers, process: int,
                   budget: int, gpu_free_bytes: int | None) -> None:
    """A run that trains on a GPU: the host side against ``budget`` (the process's RSS + the RAM available), then,
    for one process on one GPU, the step against the device's free memory."""
    from lit_speed.memory.rss_estimate import gib

    load, end = fit_check_gpu.gpu_run_host_bytes(cfg, facts, configured)
    peak = process + max(load, end)
    if peak > budget:
        raise ConfigError(f"this run trains on the GPU and needs about {gib(peak)} of host RAM at its peak (loading "
                          f"the weights {gib(load)}; at the end of fit Lightning's teardown moves the weights and the "
                          f"optimizer state to the CPU, and the export writes from there: {gib(end)}), {gib(budget)} "
                          "is there. Fix: peft=lora (the adapters' optimizer state only), optimizer=adamw8bit, or a "
                          "machine with more RAM")
    device = fit_check_gpu.gpu_to_judge(cfg)  # judged where the device's free memory can be read (or is given)
    if device is None or (gpu_free_bytes is None and not torch.cuda.is_available()):
        return
    free = torch.cuda.mem_get_info(device)[0] if gpu_free_bytes is None else gpu_free_bytes
    judged = _judge(cfg, facts, configured, 0, free, fit_check_gpu.gpu_step_bytes,
                    "the GPU memory estimate could not run ({}); the run goes on unchecked")
    if judged is None:
        return
    estimate, fix = judged
    what = (f"this run's step needs about {gib(fit_check_gpu.gpu_step_bytes(estimate))} of GPU memory (weights "
            f"{gib(estimate.weights)}, optimizer {gib(estimate.optimizer)}, step "
            f"{gib(max(estimate.step, estimate.optimizer_step))}; predicted eager, x{fit_check_gpu.GPU_SLACK:.2f} "
            f"for the allocator), cuda:{device} has {gib(free)} free")
    if fix is not None:
        raise ConfigError(f"{what}. Fix: {fix[0]} (predicted {gib(fix[1])}); scripts/plan.py shows the parts")
    raise ConfigError(f"{what}, and no lever set fits (chunked loss, a bf16 base, 8-bit states, checkpointing, LoRA, "
                      "micro-batch 1). Fix: a smaller model, data.block_size, a GPU with more memory, or "
                      "strategy=zero3_offload")
