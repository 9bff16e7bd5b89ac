"""Compose the pieces a Hydra config describes into a ``Trainer`` and run it.

``scripts/train.py`` is a thin ``@hydra.main`` wrapper around :func:`train`; tests call
:func:`train` directly on a composed config.
"""
from __future__ import annotations

import copy
import json
import logging
import time
from pathlib import Path
from typing import Any, Sequence

import hydra
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from omegaconf import DictConfig, OmegaConf

import lit_speed
from lit_speed.checkpointing import FaultTolerance, is_write_failure, stop_signal_received, write_failure_message
from lit_speed.checkpointing.resume import resolve_ckpt_path
from lit_speed.memory.allocator import KeepFreedMemory
from lit_speed.monitoring.step_progress_bar import StepProgressBar
from lit_speed.reporting.fixed_validation import process_start_time
from lit_speed.run.config_error import RunStopped
from lit_speed.run.config_rules import check_config
from lit_speed.run.config_targets import model_takes_optimizer
from lit_speed.run.console import quiet_upstream_notices
from lit_speed.run.memory_fit.fit_gate import check_fits_memory
from lit_speed.run.memory_fit.fit_levers import adds_keep_freed_memory, configured_base_dtype
from lit_speed.run.model_checks import check_activation_memory, check_tokens_fit_model
from lit_speed.run.monitor import configured_monitor
from lit_speed.run.plan_check import RunPlanCheck
from lit_speed.run.refusals import config_paths, refusals_as_config_errors
from lit_speed.run.resume_checks import check_checkpoint_matches
from lit_speed.run.startup_table import startup_rows
from lit_speed.run.summary import RunSummary
from lit_speed.run_contract import (
    EndOfRunReport,
    ModelPreparer,
    MonitoredModel,
    SummaryExtra,
    SummaryReport,
    WorkloadReport,
)
from lit_speed.strategies.config_facts import config_facts
from lit_speed.tables import format_rate, print_table

log = logging.getLogger(__name__)


def _instantiate_group(node: DictConfig | None, made: dict[str, Any] | None = None) -> list[Any]:
    """A group node is one ``_target_`` object, a dict of them, or empty; ``made``: keys instantiated already."""
    if node is None:
        return []
    if "_target_" in node:
        return [hydra.utils.instantiate(node)]
    made = made or {}
    return [made[k] if k in made else hydra.utils.instantiate(v) for k, v in node.items()
            if isinstance(v, DictConfig) and "_target_" in v]


def build(cfg: DictConfig) -> dict[str, Any]:
    """Instantiate datamodule, model, precision, strategy, callbacks, loggers and the Trainer.

    ``cfg`` is left as given: the settings the model fills in (``monitor``, ``monitor_mode``) go into a copy,
    returned as ``parts["cfg"]``.
    """
    cfg = copy.deepcopy(cfg)
    if cfg.get("seed") is not None:
        pl.seed_everything(cfg.seed, workers=True)
    datamodule: pl.LightningDataModule = hydra.utils.instantiate(cfg.data)
    check_tokens_fit_model(datamodule, cfg.model)  # tokenizer vs embedding, window vs positions: before weights load
    # plain Python values (betas as a tuple, not a ListConfig): optimizer param groups are saved in every
    # checkpoint, and an OmegaConf object there makes it unloadable with torch.load(weights_only=True)
    # a model that takes no `optimizer` argument, or whose config sets its own, builds its own optimizer
    takes_optimizer = model_takes_optimizer(cfg.model)
    optimizer = hydra.utils.instantiate(cfg.optimizer, _convert_="all") if takes_optimizer else None
    facts = config_facts(cfg)
    held = configured_base_dtype(facts)  # peft.base_dtype=auto decided from the precision, as PEFTAdapters decides it
    if isinstance(cfg.get("model"), DictConfig) and cfg.model.get("load_dtype") == "auto":
        cfg.model.load_dtype = held  # model.load_dtype follows peft.base_dtype: a bf16 folder read as it is held
    # in force before the weights load: what loading and lowering the base free goes back too
    pinned = {key: hydra.utils.instantiate(cfg.callbacks[key]) for key in facts.callback_keys("ReturnFreedMemory")}
    for callback in pinned.values():
        callback.apply()
    loading = time.perf_counter()
    model: pl.LightningModule = hydra.utils.instantiate(cfg.model, **({"optimizer": optimizer} if takes_optimizer
                                                                       else {}))
    phases = {"model_load": time.perf_counter() - loading}
    # the model knows which metric it reports, or the user's callback configs name one; the config may override it;
    # with none of them, RunPlanCheck chooses one from the metrics the first validation logs
    declared = (model.monitor, model.monitor_mode) if isinstance(model, MonitoredModel) and model.monitor \
        else configured_monitor(cfg)
    if cfg.get("monitor") is None:
        cfg.monitor = declared[0] if declared is not None else None
    if cfg.get("monitor_mode") is None:
        cfg.monitor_mode = declared[1] if declared is not None else "max"

    trainer_kwargs: dict[str, Any] = {}
    plugins: list[Any] = []
    if facts.precision_plugin:
        plugins.append(hydra.utils.instantiate(cfg.precision))
    elif facts.precision_mode is not None:
        trainer_kwargs["precision"] = facts.precision_mode  # a Lightning precision literal

    if facts.strategy.built:
        trainer_kwargs["strategy"] = hydra.utils.instantiate(cfg.strategy)
    elif cfg.get("strategy") is not None:
        trainer_kwargs["strategy"] = facts.strategy.name  # a Lightning strategy registry name

    # init (weights) before peft (adapters on the loaded base), both before every other callback
    callbacks = [*_instantiate_group(cfg.get("init")), *_instantiate_group(cfg.get("peft")),
                 *_instantiate_group(cfg.get("callbacks"), pinned), *_instantiate_group(cfg.get("accumulation"))]
    preparing = time.perf_counter()
    for part in callbacks:  # before the table and the optimizer: the table shows the model that trains
        if facts.adapters is not None and isinstance(part, lit_speed.PEFTAdapters):
            part.decide_base_dtype(facts.precision_mode, facts.strategy.deepspeed)
        if isinstance(part, ModelPreparer):
            part.prepare_model(model)
    phases["model_prepare"] = time.perf_counter() - preparing
    if adds_keep_freed_memory(facts):  # kept for the next step (handed back when available memory runs short)
        callbacks.append(KeepFreedMemory(by_default=True))
    safety_net = None
    if not any(isinstance(cb, FaultTolerance) for cb in callbacks):
        # a scheduler's SIGTERM must never lose the whole run: saving on a signal costs nothing until one comes
        safety_net = FaultTolerance(check_every_n_steps=0)
        callbacks.append(safety_net)
    run_summary = RunSummary(monitor=cfg.monitor, mode=cfg.monitor_mode)
    # RunPlanCheck first: it chooses the monitor at the first validation before RunSummary reads it
    callbacks += [RunPlanCheck(monitor=cfg.monitor, final_validation=bool(cfg.get("validate"))), run_summary]
    callbacks.insert(0, run_summary.data_ready())  # the first callback's setup: where the DataModule's set-up ends
    loggers = _instantiate_group(cfg.get("logger"))
    if not loggers:
        dropped = [cb for cb in callbacks if isinstance(cb, pl.callbacks.LearningRateMonitor)]
        if dropped:
            rank_zero_warn("logger=none: LearningRateMonitor removed (it has no logger to write to)")
            callbacks = [cb for cb in callbacks if cb not in dropped]
    if cfg.trainer.get("enable_progress_bar", True) and not any(isinstance(cb, ProgressBar) for cb in callbacks):
        callbacks.append(StepProgressBar())  # steps of max_steps, s/step and the time left (Lightning's counts epochs)
    if "enable_checkpointing" not in cfg.trainer:  # no ModelCheckpoint configured: no hidden one from Lightning
        trainer_kwargs["enable_checkpointing"] = any(isinstance(cb, pl.callbacks.ModelCheckpoint) for cb in callbacks)
    trainer: pl.Trainer = hydra.utils.instantiate(
        cfg.trainer, callbacks=callbacks, logger=loggers or False, plugins=plugins or None, **trainer_kwargs
    )
    return {"datamodule": datamodule, "model": model, "trainer": trainer, "run_summary": run_summary,
            "callbacks": callbacks, "loggers": loggers, "plugins": plugins, "optimizer": optimizer, "cfg": cfg,
            "safety_net": safety_net, "phases": phases}


def component_summaries(parts: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{class name: final_summary()}`` of the precision plugin, the strategy, the callbacks and the optimizers
    that report one (e.g. the kernels an optimizer chose by timing)."""
    trainer = parts["trainer"]
    optimizers = [getattr(o, "optimizer", o) for o in trainer.optimizers]  # unwrapped from LightningOptimizer
    return {type(part).__name__: part.final_summary()
            for part in [trainer.precision_plugin, trainer.strategy, *parts["callbacks"], *optimizers]
            if isinstance(part, SummaryReport)}


def workload_extras(parts: dict[str, Any]) -> list[SummaryExtra]:
    """The reference numbers the datamodule and the model report about themselves (e.g. a unigram baseline)."""
    return [extra for part in (parts["datamodule"], parts["model"]) if isinstance(part, WorkloadReport)
            for extra in part.summary_extras()]


def train(cfg: DictConfig, checked: bool = False) -> dict[str, Any]:
    """Build, print the start-up table, fit, validate, write ``summary.json``; return the summary dict.

    Args:
        cfg: The composed config.
        checked: The pre-flight has checked ``cfg`` (``scripts/train.py``: the config ``@hydra.main`` composed,
            checked before the job started): its config-only checks are not run again.
    """
    t0 = time.perf_counter()
    before = {"startup": seconds_since_launch()}  # imports, Hydra's composition, the pre-flight
    quiet_upstream_notices()  # Lightning's litlogger tip, torch's deprecation of a name Lightning uses
    paths = config_paths(cfg)
    with refusals_as_config_errors(lambda: True, paths):
        if not checked:
            check_config(cfg)  # the config alone: before anything is built
        check_activation_memory(cfg)  # probes a short-context copy of the model
        check_fits_memory(cfg)  # a Hugging Face model folder: the peak RSS predicted before its weights are read
        before["checks"] = time.perf_counter() - t0
        building = time.perf_counter()
        parts = build(cfg)
        cfg = parts["cfg"]  # with the model's monitor filled in
        trainer, model, dm = parts["trainer"], parts["model"], parts["datamodule"]
        rows = startup_rows(cfg, parts)
        before.update(parts["phases"])
        before["build"] = time.perf_counter() - building - sum(parts["phases"].values())
    print_table("lit_speed run", rows)

    # a refusal raised while the Trainer sets up (strategy, precision, data, checkpoint) is a config error;
    # once a training batch has run, errors propagate unchanged, with their traceback
    with refusals_as_config_errors(lambda: parts["run_summary"].samples == 0, paths):
        # ckpt_path=last -> the newest checkpoint that verifies (damaged ones are skipped with a warning)
        ckpt_path = resolve_ckpt_path(cfg.get("ckpt_path"), trainer)
        check_checkpoint_matches(ckpt_path, model, parts["optimizer"])
        parts["run_summary"].fit_called_at = time.perf_counter()
        try:
            trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
        except BaseException as error:  # interrupted or failed: what was done is still written down
            _write_stopped_summary(cfg, parts, rows, error, t0)
            if is_write_failure(error):  # no space / no permission: one line, the checkpoint kept, how to resume
                raise RunStopped(write_failure_message(error, trainer), exit_code=74) from error  # EX_IOERR
            raise
    summary = parts["run_summary"].summary(trainer)
    after: dict[str, float] = {}
    if cfg.get("validate") and not trainer.interrupted and not trainer.fast_dev_run and not stop_signal_received(trainer):
        last = parts["run_summary"].last_validation
        if last is not None and last[0] == trainer.global_step and last[1]:
            # the fit validated these very weights at its last step: the final validation is that one, not a repeat
            summary["final_val"], summary["final_val_from"] = dict(last[1]), f"the fit's validation at step {last[0]}"
            after["final_validation"] = 0.0
        else:
            validating = time.perf_counter()
            val = trainer.validate(model, datamodule=dm, verbose=False)
            summary["final_val"] = {k: float(v) for k, v in (val[0] if val else {}).items()}
            after["final_validation"] = time.perf_counter() - validating
    if (late := stop_signal_received(trainer)) is not None:  # SIGTERM/SIGUSR1 after the last training batch
        raise RunStopped(*late)
    extras = workload_extras(parts)
    summary.update({extra.key: extra.value for extra in extras})
    components = component_summaries(parts)  # loss scale, verdicts, stop reason, ...
    if components:
        summary["components"] = components
    summary["total_wall_time_s"] = round(time.perf_counter() - t0, 3)
    split = {**before, **summary["time_split_s"], **after}
    # what no phase names: the fit's own bookkeeping outside its hooks, the summary's component reports
    split["other"] = max(before["startup"] + summary["total_wall_time_s"] - sum(split.values()), 0.0)
    summary["time_split_s"] = {k: round(v, 3) for k, v in split.items()}
    summary["launch_to_end_s"] = round(before["startup"] + summary["total_wall_time_s"], 3)
    summary["startup"] = rows
    summary["config"] = OmegaConf.to_container(cfg, resolve=True)
    write_summary(cfg, trainer, summary, extras)
    return summary


def seconds_since_launch() -> float:
    """Seconds since this process started (the kernel's start time, so imports and Hydra count too; see
    :func:`lit_speed.reporting.fixed_validation.process_start_time`)."""
    return max(time.time() - process_start_time(), 0.0)


def _write_stopped_summary(cfg: DictConfig, parts: dict[str, Any], rows: dict[str, str], error: BaseException,
                           t0: float) -> None:
    """``summary.json`` of a run that did not finish: what it did, and how it stopped (never hides ``error``)."""
    try:
        trainer = parts["trainer"]
        summary = parts["run_summary"].summary(trainer)
        stopped = next((getattr(cb, "interrupted", None) or getattr(cb, "failure", None) for cb in trainer.callbacks
                        if getattr(cb, "interrupted", None) or getattr(cb, "failure", None)), None)
        summary["status"] = "interrupted" if isinstance(error, (SystemExit, KeyboardInterrupt)) else "failed"
        summary["stopped"] = stopped or f"{type(error).__name__}: {str(error).strip()[:300]}"
        summary["total_wall_time_s"] = round(time.perf_counter() - t0, 3)
        summary["startup"] = rows
        summary["config"] = OmegaConf.to_container(cfg, resolve=True)
        _write_summary_file(cfg, summary)
    except Exception as failure:  # noqa: BLE001 - the run's own error is the one to show
        log.warning(f"could not write summary.json of the stopped run: {failure}")


@rank_zero_only
def _write_summary_file(cfg: DictConfig, summary: dict[str, Any]) -> None:
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))


@rank_zero_only
def write_summary(cfg: DictConfig, trainer: pl.Trainer, summary: dict[str, Any],
                  extras: Sequence[SummaryExtra] = ()) -> None:
    """Write ``summary.json`` into the run folder and print the end-of-run table."""
    summary.setdefault("status", "finished")
    _write_summary_file(cfg, summary)
    out = Path(cfg.paths.output_dir)
    rows = {
        "wall time (fit)": f"{summary['fit_wall_time_s']:.1f} s ({summary['train_time_s']:.1f} s training)",
        "launch to end": time_split_row(summary),
        "throughput": format_rate(summary["samples_per_sec"], "samples/s")
        + (f", {format_rate(summary['tokens_per_sec'], 'tokens/s')}" if summary.get("tokens_per_sec") else ""),
        "peak memory (RSS)": f"{summary['peak_rss_bytes'] / 2**20:,.0f} MiB",
        "optimizer steps": str(summary["global_step"]),
        f"best {summary['monitor']}": "n/a" if summary["best_val"] is None
        else f"{summary['best_val']:.4f} (step {summary['best_step']})",
    }
    for key, value in summary.get("final_val", {}).items():
        rows[f"final {key}"] = f"{value:.4f}"
    for extra in extras:  # a count as a count, a loss or a share with 4 decimals
        rows[extra.label] = f"{extra.value:,.0f}" if float(extra.value).is_integer() else f"{extra.value:.4f}"
    for part in [trainer.precision_plugin, trainer.strategy, *trainer.callbacks]:
        if isinstance(part, EndOfRunReport):
            rows.update({str(k): str(v) for k, v in part.end_rows().items()})
    rows["summary"] = str(out / "summary.json")
    print_table("lit_speed summary", rows)


def time_split_row(summary: dict[str, Any]) -> str:
    """``"129.9 s: training 45.2, export 48.0, ..."``: the phases of ``summary["time_split_s"]`` that took at
    least 0.1 s, longest first."""
    split = summary.get("time_split_s", {})
    shown = sorted(((k, v) for k, v in split.items() if v >= 0.1), key=lambda kv: -kv[1])
    return f"{summary.get('launch_to_end_s', 0.0):.1f} s: " + ", ".join(f"{k.replace('_', ' ')} {v:.1f}"
                                                                       for k, v in shown)


def optimized_metric(cfg: DictConfig, summary: dict[str, Any]) -> float | None:
    """The value Hydra sweepers optimise: the monitor's final validation value, else its best value.

    The monitor is the run's (``summary["monitor"]``: the model's own when ``cfg.monitor`` is null).
    """
    final = summary.get("final_val", {})
    value = final.get(summary.get("monitor", cfg.get("monitor")), summary.get("best_val"))
    return None if value is None else float(value)

