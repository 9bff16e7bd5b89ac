"""The runner's declared contract (:mod:`lit_speed.run_contract`): who reports what, and ``build`` leaves its input alone."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from lit_speed.accumulation.accumulation_scheduler import AccumulationScheduler
from lit_speed.checkpointing.atomic_checkpoint_io import AtomicCheckpointIO
from lit_speed.checkpointing.fault_tolerance import FaultTolerance
from lit_speed.curriculum.curriculum_data_module import CurriculumDataModule
from lit_speed.curriculum.curriculum_early_stopping import CurriculumEarlyStopping
from lit_speed.data.charlm import CharLMDataModule
from lit_speed.data.digits import DigitsDataModule
from lit_speed.data.text_folder import TextFolderDataModule
from lit_speed.finetune import InitWeights, PEFTAdapters
from lit_speed.memory.activation_checkpointing import ActivationCheckpointing
from lit_speed.memory.compile_model import CompileModel
from lit_speed.models.gpt import GPTModule
from lit_speed.models.mlp import MLPClassifier
from lit_speed.monitoring.device_stats_logger import DeviceStatsLogger
from lit_speed.precision.guarded_precision import GuardedPrecision
from lit_speed.precision.zero_guard import GuardedDeepSpeedPrecision
from lit_speed.reporting.fixed_validation import FixedValidationClock
from lit_speed.reporting.time_to_target import TimeToTarget
from lit_speed.run.plan_check import largest_accumulation_factor
from lit_speed.run.runner import build, component_summaries, workload_extras
from lit_speed.run.startup_table import _accumulation_factor
from lit_speed.run_contract import (
    AccumulationReport,
    ModelPreparer,
    MonitoredModel,
    StartupReport,
    SummaryExtra,
    SummaryReport,
    WorkloadReport,
    startup_rows_of,
)
from lit_speed.strategies.zero_strategy import ZeroStrategy

STARTUP_REPORTERS = [DigitsDataModule, CharLMDataModule, CurriculumDataModule, GuardedPrecision, ZeroStrategy,
                     AccumulationScheduler, CurriculumEarlyStopping, DeviceStatsLogger, FaultTolerance,
                     AtomicCheckpointIO, CompileModel, ActivationCheckpointing, TimeToTarget, TextFolderDataModule,
                     InitWeights, PEFTAdapters]
SUMMARY_REPORTERS = [GuardedPrecision, GuardedDeepSpeedPrecision, ZeroStrategy, AccumulationScheduler,
                     CurriculumEarlyStopping, DeviceStatsLogger, FaultTolerance, CompileModel, ActivationCheckpointing,
                     TimeToTarget, FixedValidationClock, InitWeights, PEFTAdapters]


@pytest.mark.parametrize("cls", STARTUP_REPORTERS, ids=lambda c: c.__name__)
def test_component_reports_startup_rows(cls):
    assert issubclass(cls, StartupReport)


@pytest.mark.parametrize("cls", SUMMARY_REPORTERS, ids=lambda c: c.__name__)
def test_component_reports_a_final_summary(cls):
    assert issubclass(cls, SummaryReport)


def test_workloads_and_accumulation_report_through_the_contract():
    assert issubclass(CharLMDataModule, WorkloadReport) and not issubclass(DigitsDataModule, WorkloadReport)
    scheduler = AccumulationScheduler(factors={0: 2, 10: 4})
    assert isinstance(scheduler, AccumulationReport) and scheduler.current_factor == 2
    assert isinstance(MLPClassifier(), MonitoredModel) and isinstance(GPTModule(), MonitoredModel)
    assert issubclass(TextFolderDataModule, WorkloadReport)


def test_model_preparers_transform_the_model_before_the_start_up_table(make_cfg):
    assert issubclass(InitWeights, ModelPreparer) and issubclass(PEFTAdapters, ModelPreparer)
    parts = build(make_cfg(["peft=lora"]))
    trainable = sum(p.numel() for p in parts["model"].parameters() if p.requires_grad)
    assert 0 < trainable < sum(p.numel() for p in parts["model"].parameters())  # adapters in, base frozen, pre-fit


class _Reports:
    def describe(self):
        return {"mine": 3}

    def final_summary(self):
        return {"events": 1}

    def summary_extras(self):
        return [SummaryExtra("baseline", "baseline val/loss", 1.5)]


class _Silent:  # an attribute named like a contract method that is not one is ignored as well
    describe = None
    final_summary = None
    current_factor = None


def test_runner_reads_only_objects_that_implement_the_contract():
    assert startup_rows_of(_Reports()) == {"mine": "3"}
    assert startup_rows_of(_Silent()) == {} and startup_rows_of(object()) == {}
    trainer = SimpleNamespace(precision_plugin=object(), strategy=_Silent(), accumulate_grad_batches=3,
                              optimizers=[object()])
    parts = {"trainer": trainer, "callbacks": [_Reports(), _Silent(), object()], "datamodule": _Reports(),
             "model": object()}
    assert component_summaries(parts) == {"_Reports": {"events": 1}}

    class _ReportingOptimizer:  # an optimizer that reports the kernels it chose (e.g. MuonAdamW)
        def final_summary(self):
            return {"kernel": "fused"}

    trainer.optimizers = [_ReportingOptimizer()]
    assert component_summaries(parts)["_ReportingOptimizer"] == {"kernel": "fused"}
    assert workload_extras(parts) == [SummaryExtra("baseline", "baseline val/loss", 1.5)]
    assert _accumulation_factor(trainer, [_Silent(), object()]) == 3
    assert largest_accumulation_factor([_Silent(), SimpleNamespace(factors={0: 9})], 2) == 2


def test_build_does_not_change_the_config_it_is_given(make_cfg):
    cfg = make_cfg(["trainer.max_epochs=1", "logger=none", "accumulation=fixed"])
    assert cfg.monitor is None  # the model fills it in: in build's copy
    before = copy.deepcopy(cfg)
    parts = build(cfg)
    assert OmegaConf.to_container(cfg, resolve=False) == OmegaConf.to_container(before, resolve=False)
    assert parts["cfg"].monitor == "val/acc" and parts["cfg"].monitor_mode == "max"


def test_runner_prefixes_a_component_refusal_with_its_config_path(make_cfg):
    from lit_speed.run.config_error import ConfigError
    from lit_speed.run.refusals import config_paths, with_config_path
    from lit_speed.run.runner import train

    cfg = make_cfg(["accumulation=fixed", "accumulation.micro_batch=0", "logger=none"])
    assert config_paths(cfg)["AccumulationScheduler"] == "accumulation"
    with pytest.raises(ConfigError, match=r"^accumulation\.micro_batch=0: AccumulationScheduler\(micro_batch=0\): "
                                          r"micro_batch must be an int >= 1") as info:
        train(cfg)
    assert isinstance(info.value.__cause__, Exception)  # chained: the original error stays in the traceback
    paths = {"GuardedPrecision": "precision"}
    assert with_config_path("GuardedPrecision: the scaler settings need", paths) == \
        "precision: GuardedPrecision: the scaler settings need"
    assert with_config_path("Lion(lr=-1): lr must be >= 0", paths) is None  # not built from this config
    assert with_config_path("val_fraction must be in (0, 1)", paths) is None


@pytest.mark.slow  # 10-28 s: the default tier stays near 10 minutes on 2 cores
def test_seconds_since_launch_counts_from_the_process_start_to_a_clock_tick() -> None:
    """A child's own launch clock, read first thing, is inside the parent's wall time around it (psutil's
    create_time, rounded to /proc/stat's whole-second boot time, put it ~0.5 s early on this machine)."""
    import subprocess
    import sys
    import time

    code = ("import time; from lit_speed.run.runner import seconds_since_launch as s; "
            "print(s(), time.time())")
    start = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    since_launch, now = float(out[0]), float(out[1])
    assert 0.0 < since_launch <= now - start + 0.01  # the child's clock cannot have started before the parent's call
