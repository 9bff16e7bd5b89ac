"""The refusal before the weights load: :func:`check_fits_memory`, what ``scripts/train.py`` runs for a Hugging Face
model folder. The predictions are :mod:`lit_speed.run.fit_check`'s (the process's peak RSS of a CPU run) and
:mod:`lit_speed.run.fit_check_gpu`'s (a GPU run's host side and its step on one GPU)."""
from __future__ import annotations

import warnings

from omegaconf import DictConfig

from lit_speed.run import fit_check, fit_check_gpu
from lit_speed.run.config_error import ConfigError


def check_fits_memory(cfg: DictConfig, available_bytes: int | None = None, gpu_free_bytes: int | None = None) -> None:
    """Refuse, before the weights are read, a Hugging Face run whose predicted peak RSS exceeds the memory this
    machine has free, naming the cheapest lever set (:func:`lever_sets`) that fits. A run on a GPU is judged by what
    it holds in the host's RAM and, on one GPU, by its step's GPU memory against the device's free memory
    (:mod:`lit_speed.run.fit_check_gpu`; ``gpu_free_bytes`` stands in for ``torch.cuda.mem_get_info`` in tests)."""
    import psutil

    from lit_speed.memory.rss_estimate import gib

    if fit_check.hf_folder(cfg) is None:
        return
    process = psutil.Process().memory_info().rss
    available = psutil.virtual_memory().available if available_bytes is None else available_bytes
    budget = process + available
    configured = fit_check.configured_levers(cfg)
    # the meta-device model and the optimizer, built once
    facts = fit_check.run_facts(cfg, fit_check.hf_folder(cfg), configured)
    if fit_check_gpu.trains_on_gpu(cfg):
        fit_check_gpu.check_gpu_run(cfg, facts, configured, process, budget, gpu_free_bytes)
        return
    if fit_check.generous_bound(facts, process) <= budget:
        return  # fits even counted generously: no probe
    try:
        cache: dict = {}
        estimate = fit_check.estimate_run(cfg, configured, process, facts, cache=cache)
    except Exception as error:  # noqa: BLE001 - a probe that cannot run must not stop a run it cannot judge
        warnings.warn(f"lit_speed.run.fit_check: the memory estimate could not run ({type(error).__name__}: "
                      f"{error}); the run goes on unchecked. scripts/plan.py shows the estimate's parts", stacklevel=2)
        return
    if estimate.peak <= budget:
        return
    callbacks = list(fit_check.callback_nodes(cfg))
    for levers in fit_check.lever_sets(configured, not configured.lora)[1:]:
        other = fit_check.estimate_run(cfg, levers, process, cache=cache)
        if other.peak <= budget:
            fix = " ".join(levers.overrides(configured, callbacks))
            raise ConfigError(f"this run needs about {gib(estimate.peak)} of RAM at its peak (lit_speed.memory."
                              f"rss_estimate: weights {gib(estimate.weights)}, optimizer {gib(estimate.optimizer)}, "
                              f"step {gib(max(estimate.step, estimate.optimizer_step))}), {gib(budget)} is there. "
                              f"Fix: {fix} (predicted {gib(other.peak)}); scripts/plan.py shows every option")
    raise ConfigError(f"this run needs about {gib(estimate.peak)} of RAM at its peak, {gib(budget)} is there, and no "
                      "lever set fits (chunked loss, a bf16 base, 8-bit states, checkpointing, LoRA, micro-batch 1). "
                      "Fix: a smaller model, data.block_size, or a machine with more memory")
