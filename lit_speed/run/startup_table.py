"""The start-up table's rows that the runner computes itself (the components' own rows come through the run
contract's ``describe()``): the effective batch and where an accumulation schedule takes it, what
``val_check_interval`` counts, the optimizer, the host memory the run may use."""
from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from omegaconf import DictConfig

from lit_speed.memory.host_memory import describe as describe_host_memory
from lit_speed.memory.host_memory import host_memory
from lit_speed.memory.model_state import parameter_counts
from lit_speed.run.plan_check import largest_accumulation_factor
from lit_speed.run_contract import (
    AccumulationPlan,
    AccumulationReport,
    startup_rows_of,
)


def _accumulation_factor(trainer: pl.Trainer, callbacks: list[Any]) -> int:
    for cb in callbacks:
        if isinstance(cb, pl.callbacks.GradientAccumulationScheduler):
            return cb.get_accumulate_grad_batches(0)
        if isinstance(cb, AccumulationReport):
            return cb.current_factor
    return trainer.accumulate_grad_batches


def effective_batch_row(micro: int | None, world: int, trainer: pl.Trainer, callbacks: list[Any]) -> tuple[str, int]:
    """The effective batch at the start and where an accumulation schedule takes it; and the largest factor."""
    plan = next((cb for cb in callbacks if isinstance(cb, AccumulationPlan)), None)
    if plan is not None:
        accum, largest, then = plan.accumulation_plan(micro, world)
    else:
        accum, then = _accumulation_factor(trainer, callbacks), ""
        largest = largest_accumulation_factor(callbacks, trainer.accumulate_grad_batches)
    if micro:
        row = f"{micro} micro x {accum} accumulation x {world} process(es) = {micro * accum * world}"
    else:
        row = f"accumulation {accum}, world size {world}"
    return row + (f" at the start; {then}" if then else ""), max(accum, largest)


def validation_row(trainer: pl.Trainer, largest_factor: int) -> str:
    """When validation runs, and what ``val_check_interval`` counts when gradients accumulate."""
    if trainer.limit_val_batches == 0:
        return "off (trainer.limit_val_batches=0)"
    interval, every_n = trainer.val_check_interval, trainer.check_val_every_n_epoch
    if not isinstance(interval, (int, float)) or isinstance(interval, bool):
        return f"every {interval} of wall time (trainer.val_check_interval)"
    epochs = "of each epoch" if every_n == 1 else f"of every {every_n}th epoch" if every_n else "counted across epochs"
    if isinstance(interval, float):
        end = "at the end of each epoch" if every_n == 1 else f"at the end of every {every_n}th epoch"
        return end if interval == 1.0 else f"every {interval:g} of an epoch, {epochs}"
    row = f"every {interval} training batches {epochs} (trainer.val_check_interval)"
    if largest_factor > 1:
        row += (f": training batches are micro-batches, so under x{largest_factor} accumulation that is every "
                f"~{max(1, round(interval / largest_factor))} optimizer steps; to count optimizer steps: "
                "'callbacks=[default,validate_every_n_steps]' callbacks.validate_every_n_steps.every_n_steps=<N> "
                "trainer.val_check_interval=null")
    return row


def startup_rows(cfg: DictConfig, parts: dict[str, Any]) -> dict[str, str]:
    """One row per setting that changes speed or memory, with the derived effective batch."""
    trainer, model, dm = parts["trainer"], parts["model"], parts["datamodule"]
    micro = getattr(dm, "batch_size", None)
    world = trainer.world_size
    batch_row, largest_factor = effective_batch_row(micro, world, trainer, parts["callbacks"])
    counts = parameter_counts(model)  # tied weights once
    n_params, n_trainable = counts.total, counts.trainable
    precision = trainer.precision_plugin
    rows = {
        "precision": getattr(precision, "precision", str(trainer.precision)),
        "strategy": f"{type(trainer.strategy).__name__} on {type(trainer.accelerator).__name__} "
                    f"({trainer.num_devices} device(s) x {trainer.num_nodes} node(s))",
        "effective batch": batch_row,
        "model": f"{type(model).__name__}: {n_params:,} parameters" + (
            f" ({n_trainable:,} trainable, {n_params - n_trainable:,} frozen)" if n_trainable != n_params else ""),
        "optimizer": optimizer_row(parts["optimizer"]),
        "threads": f"{torch.get_num_threads()} intra-op (torch)",
        "host memory": describe_host_memory(host_memory()),  # the cgroup's limit where it is below the machine's
        "monitor": f"{cfg.monitor} ({cfg.monitor_mode})" if cfg.monitor is not None else
                   "none named: chosen at the first validation from the metrics it logs (a val loss first)",
        "validation": validation_row(trainer, largest_factor),  # a cadence callback's own row replaces it
    }
    if parts["optimizer"] is None and cfg.get("optimizer") is not None:
        rows["optimizer"] = "the model's own (its config's model.optimizer, or configure_optimizers): optimizer= unused"
    for part in [dm, precision, *parts["callbacks"]]:
        rows.update(startup_rows_of(part))
    rows.update(startup_rows_of(trainer.strategy, model))  # a strategy sizes its memory estimate from the model
    if parts.get("safety_net") is not None:
        rows["fault tolerance"] = ("added: no FaultTolerance among the callbacks, so the runner saves last.ckpt on "
                                   "SIGTERM/SIGUSR1 (exit 128+signal) and nothing else; callbacks=default checkpoints "
                                   "at every validation")
    return rows


def optimizer_row(factory: Any) -> str:
    """The optimizer a ``_partial_`` factory builds, with its LR and the kernel settings decided at run time."""
    if factory is None:
        return "the model's own (configure_optimizers)"
    func = getattr(factory, "func", factory)
    keywords = getattr(factory, "keywords", {}) or {}
    shown = [f"{k}={keywords[k]}" for k in ("lr", "adamw_lr", "fused", "foreach", "ns_dtype", "adamw_kernel", "block_size")
             if keywords.get(k) is not None]
    auto = [k for k in ("ns_dtype", "adamw_kernel") if keywords.get(k) == "auto"]
    note = f"; {' and '.join(auto)} timed on this machine before the first step" if auto else ""
    return f"{getattr(func, '__name__', type(factory).__name__)}({', '.join(shown)}){note}"
