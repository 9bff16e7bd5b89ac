"""The refusal before the weights load: :func:`check_fits_memory`, what ``scripts/train.py`` runs for a Hugging Face
model folder.

One walk, top to bottom: read the run's facts once (:mod:`~lit_speed.run.memory_fit.fit_check`); for a run on a GPU,
check what it holds in the host's RAM (:mod:`~lit_speed.run.memory_fit.fit_check_gpu`, no probe); pick the one
memory the step is judged against (the host's RAM for a CPU run, the device's free memory for one process on one
GPU); judge it (no probe where a generous bound fits, the configured levers' estimate, then the cheapest lever set
that fits); refuse, naming that set.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

from omegaconf import DictConfig

from lit_speed.run.config_error import ConfigError
from lit_speed.run.memory_fit import fit_check, fit_check_gpu, fit_levers

#: How a refusal names each of :data:`~lit_speed.run.memory_fit.fit_levers.LEVERS`.
_LEVER_WORDS = {"chunked_loss": "chunked loss", "base_bf16": "a bf16 base", "low_bit_states": "8-bit states",
                "checkpointing": "checkpointing", "base_int8": "an int8 base", "lora": "LoRA"}
#: The levers the refusal lists when no set of them fits: every lever tried, then the halved micro-batches.
_ALL_LEVERS = ", ".join(_LEVER_WORDS[name] for name in fit_levers.LEVERS) + ", micro-batch 1"


@dataclass(frozen=True)
class JudgedMemory:
    """The memory a run's step is judged against and how a refusal names it."""

    budget: int                       # bytes there are
    process: int                      # bytes the process holds already, part of the need (0 on a GPU)
    need: Callable[[Any], int]        # an estimate (RSSEstimate) -> the bytes it needs of this memory
    unchecked: str                    # the warning when the estimate cannot run (``{}``: the error)
    refusal: Callable[[Any, tuple[str, int] | None], str]  # (estimate, fix or None) -> the message


def check_fits_memory(cfg: DictConfig, available_bytes: int | None = None, gpu_free_bytes: int | None = None) -> None:
    """Refuse, before the weights are read, a Hugging Face run whose predicted peak RSS exceeds the memory this
    machine has free, naming the cheapest lever set (:func:`~lit_speed.run.memory_fit.fit_levers.lever_sets`) that
    fits. A run on a GPU is judged by what it holds in the host's RAM and, on one GPU, by its step's GPU memory against
    the device's free memory (:mod:`~lit_speed.run.memory_fit.fit_check_gpu`; ``gpu_free_bytes`` stands in for
    ``torch.cuda.mem_get_info`` in tests).

    Raises:
        ConfigError: The run will not fit: what it needs, what is there, and the fix.
    """
    import psutil

    from lit_speed.memory.host_memory import host_memory

    folder = fit_check.hf_folder(cfg)
    if folder is None:
        return
    process = psutil.Process().memory_info().rss
    budget = process + (host_memory().available if available_bytes is None else available_bytes)
    configured = fit_levers.configured_levers(cfg)
    facts = fit_check.run_facts(cfg, folder, configured)  # the meta-device model and the optimizer, built once
    if fit_check_gpu.trains_on_gpu(cfg):
        _check_gpu_host(cfg, facts, configured, process, budget)
        memory = _gpu_memory(cfg, gpu_free_bytes)
    else:
        memory = _host_memory(process, budget)
    if memory is None:
        return
    judged = _judge(cfg, facts, configured, memory)
    if judged is not None:
        raise ConfigError(memory.refusal(*judged))


def _check_gpu_host(cfg: DictConfig, facts: fit_check.RunFacts, configured: fit_levers.Levers, process: int,
                    budget: int) -> None:
    """A run that trains on a GPU: what it holds in the host's RAM (the weights while they load, the weights and the
    optimizer state at the end of fit) against ``budget`` (the process's RSS + the RAM available)."""
    from lit_speed.memory.rss_estimate import gib

    load, end = fit_check_gpu.gpu_run_host_bytes(cfg, facts, configured)
    peak = process + max(load, end)
    if peak > budget:
        raise ConfigError(f"this run trains on the GPU and needs about {gib(peak)} of host RAM at its peak (loading "
                          f"the weights {gib(load)}; at the end of fit Lightning's teardown moves the weights and the "
                          f"optimizer state to the CPU, and the export writes from there: {gib(end)}), {gib(budget)} "
                          "is there. Fix: peft=lora (the adapters' optimizer state only), optimizer=adamw8bit, or a "
                          "machine with more RAM")


def _host_memory(process: int, budget: int) -> JudgedMemory:
    """A CPU run: its peak RSS against the process's RSS + the RAM available."""
    from lit_speed.memory.rss_estimate import gib

    def refusal(estimate: Any, fix: tuple[str, int] | None) -> str:
        if fix is None:
            return (f"this run needs about {gib(estimate.peak)} of RAM at its peak, {gib(budget)} is there, "
                    f"and no lever set fits ({_ALL_LEVERS}). Fix: a smaller model, data.block_size, or a machine with "
                    "more memory")
        return (f"this run needs about {gib(estimate.peak)} of RAM at its peak (lit_speed.memory.rss_estimate: "
                f"weights {gib(estimate.weights)}, optimizer {gib(estimate.optimizer)}, step "
                f"{gib(max(estimate.step, estimate.optimizer_step))}), {gib(budget)} is there. Fix: {fix[0]} "
                f"(predicted {gib(fix[1])}); scripts/plan.py shows every option")

    return JudgedMemory(budget, process, lambda estimate: estimate.peak,
                        "the memory estimate could not run ({}); the run goes on unchecked. scripts/plan.py shows the "
                        "estimate's parts", refusal)


def _gpu_memory(cfg: DictConfig, gpu_free_bytes: int | None) -> JudgedMemory | None:
    """A run on one GPU: its step's GPU memory against the device's free memory; None where the GPU side is not
    judged (several processes, a strategy, or no device whose free memory can be read or is given)."""
    import torch

    from lit_speed.memory.rss_estimate import gib

    device = fit_check_gpu.gpu_to_judge(cfg)
    if device is None or (gpu_free_bytes is None and not torch.cuda.is_available()):
        return None
    free = torch.cuda.mem_get_info(device)[0] if gpu_free_bytes is None else gpu_free_bytes

    def refusal(estimate: Any, fix: tuple[str, int] | None) -> str:
        what = (f"this run's step needs about {gib(fit_check_gpu.gpu_step_bytes(estimate))} of GPU memory (weights "
                f"{gib(estimate.weights)}, optimizer {gib(estimate.optimizer)}, step "
                f"{gib(max(estimate.step, estimate.optimizer_step))}; predicted eager, "
                f"x{fit_check_gpu.GPU_SLACK:.2f} for the allocator), cuda:{device} has {gib(free)} free")
        if fix is not None:
            return f"{what}. Fix: {fix[0]} (predicted {gib(fix[1])}); scripts/plan.py shows the parts"
        return (f"{what}, and no lever set fits ({_ALL_LEVERS}). Fix: a smaller model, data.block_size, a GPU with "
                "more memory, or strategy=zero3_offload")

    return JudgedMemory(free, 0, fit_check_gpu.gpu_step_bytes,
                        "the GPU memory estimate could not run ({}); the run goes on unchecked", refusal)


def _judge(cfg: DictConfig, facts: fit_check.RunFacts, configured: fit_levers.Levers, memory: JudgedMemory
           ) -> tuple[Any, tuple[str, int] | None] | None:
    """None when the run fits ``memory`` (by the generous bound without a probe, or by the configured levers'
    estimate) or its probe cannot run (a warning: ``memory.unchecked`` with the error); else the configured estimate
    and the cheapest lever set whose need fits (``(overrides, its need)``, or None when none does)."""
    if fit_check.generous_bound(facts, memory.process) <= memory.budget:
        return None  # fits even counted generously: no probe
    cache: dict = {}
    try:
        estimate = fit_check.estimate_run(cfg, configured, memory.process, facts, cache=cache)
    except Exception as error:  # noqa: BLE001 - a probe that cannot run must not stop a run it cannot judge
        warnings.warn("lit_speed.run.memory_fit.fit_check: " + memory.unchecked.format(f"{type(error).__name__}: "
                                                                                       f"{error}"), stacklevel=3)
        return None
    if memory.need(estimate) <= memory.budget:
        return None
    callbacks = list(fit_levers.callback_nodes(cfg))
    for levers in fit_levers.lever_sets(configured, not configured.lora)[1:]:
        other = memory.need(fit_check.estimate_run(cfg, levers, memory.process, cache=cache))
        if other <= memory.budget:
            return estimate, (" ".join(levers.overrides(configured, callbacks)), other)
    return estimate, None
