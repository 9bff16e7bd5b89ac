"""DeepSpeed ZeRO stages 1-3, with CPU offload, on GPUs and on CPU-only machines."""
from __future__ import annotations

import functools
import json
import logging
import os
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Any, Callable, Mapping

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.plugins.precision import DeepSpeedPrecision, Precision
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lit_speed import GuardedDeepSpeedPrecision, state_bytes_per_param
from lit_speed.compat import deepspeed as ds_compat
from lit_speed.compat import lightning as pl_compat
from lit_speed.compat.deepspeed import BatchSizeFromLoader
from lit_speed.interfaces import find_accumulation_decider
from lit_speed.memory.model_state import ModelStateBytes, ZeroLayout, model_state_bytes, parameter_counts
from lit_speed.precision import modes
from lit_speed.strategies.consolidate import check_resume_world_size
from lit_speed.strategies.ds_accelerator import use_deepspeed_accelerator
from lit_speed.strategies.memory_estimate import format_bytes, measured_optimizer_state_bytes
from lit_speed.strategies.zero_config import (
    PRECISIONS,
    check_offload_optimizer,
    check_precision,
    check_zero_optimizer,
    fp16_section,
    merge_config,
    validate_config,
)

# Non-finite policies DeepSpeed itself honours: its fp16 dynamic loss scaler skips overflowing steps.
# fp16: DeepSpeed's loss scaler skips; the others: GuardedDeepSpeedPrecision makes DeepSpeed discard the step
_HONOURED_NONFINITE = {p: ("skip",) for p in PRECISIONS}


class ZeroStrategy(BatchSizeFromLoader, DeepSpeedStrategy):
    """Lightning's :class:`~lightning.pytorch.strategies.DeepSpeedStrategy`, checked up front and runnable on CPU.

    Adds to Lightning's strategy: the CPU accelerator (DeepSpeed's CPU backend over gloo, 1 or more processes),
    validation of the DeepSpeed config and of offload/precision combinations before anything heavy starts,
    a per-rank memory estimate for the start-up table, gradient accumulation that follows
    ``trainer.accumulate_grad_batches`` even when a callback changes it mid-run, and precision taken from any
    precision plugin exposing ``.precision`` (e.g. ``lit_speed.GuardedPrecision``).

    Args:
        stage: ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters.
        offload_optimizer: Keep optimizer state in CPU RAM and step it there (needs ``DeepSpeedCPUAdam``).
        offload_parameters: Keep parameters in CPU RAM (stage 3 only).
        pin_memory: Page-locked host buffers for offload (faster host-device copies; a no-op on CPU).
        contiguous_gradients: Copy gradients into one buffer as they are produced (less fragmentation).
        overlap_comm: Overlap gradient reduction with the backward pass.
        allgather_bucket_size: Elements gathered at once (smaller = less memory, more messages).
        reduce_bucket_size: Elements reduced at once (smaller = less memory, more messages).
        sub_group_size: Stage 3: parameters stepped at a time by the offloaded optimizer.
        config: Raw DeepSpeed config (dict or JSON path), deep-merged over the settings above; unknown keys
            are refused (DeepSpeed would silently ignore them).
        build_shm_comm: On CPU, JIT-build DeepSpeed's shared-memory collectives (~66 s cold) instead of
            plain gloo. Faster all-reduce for large models on one machine.
        load_full_weights: Stage 3: resume from a single consolidated file instead of a sharded directory.
        logging_level: DeepSpeed's log level.
        process_group_backend: ``None`` = nccl on CUDA, gloo on CPU.
        precision_plugin: A precision plugin; any plugin with ``.precision`` is converted to DeepSpeed's.
        **kwargs: Further :class:`DeepSpeedStrategy` arguments (e.g. ``loss_scale``, ``cluster_environment``).

    Raises:
        ValueError: On an invalid stage, unknown config keys, parameter offload below stage 3, stage-3
            incompatibilities; at setup: fp16 on CPU, offload with an optimizer that cannot run on CPU.

    Example::

        trainer = Trainer(accelerator="cpu", devices=2, precision="bf16-mixed",
                          strategy=ZeroStrategy(stage=2))
    """

    strategy_name = "lit_speed_zero"

    def __init__(self, stage: int = 2, offload_optimizer: bool = False, offload_parameters: bool = False,
                 pin_memory: bool = True, contiguous_gradients: bool = True, overlap_comm: bool = True,
                 allgather_bucket_size: int = 200_000_000, reduce_bucket_size: int = 200_000_000,
                 sub_group_size: int = 1_000_000_000, config: Mapping[str, Any] | str | Path | None = None,
                 build_shm_comm: bool = False, load_full_weights: bool = False, logging_level: int = logging.WARN,
                 process_group_backend: str | None = None, precision_plugin: Precision | None = None,
                 **kwargs: Any) -> None:
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeroStrategy(stage={stage!r}): stage must be one of (1, 2, 3), got {stage!r}; for no "
                             "sharding use Trainer(strategy='ddp')")
        self._source_precision: Any = None
        super().__init__(stage=stage, offload_optimizer=offload_optimizer, offload_parameters=offload_parameters,
                         pin_memory=pin_memory, contiguous_gradients=contiguous_gradients, overlap_comm=overlap_comm,
                         allgather_bucket_size=allgather_bucket_size, reduce_bucket_size=reduce_bucket_size,
                         sub_group_size=sub_group_size, load_full_weights=load_full_weights,
                         logging_level=logging_level, process_group_backend=process_group_backend,
                         precision_plugin=precision_plugin, **kwargs)
        self.config = merge_config(self.config, _read_config(config))
        validate_config(self.config)
        self.build_shm_comm = build_shm_comm
        self._estimate: ModelStateBytes | None = None
        self._deepspeed_patches = ExitStack()  # compat patches held from environment set-up to teardown
        # Adam's two float32 moments until the optimizer is built and asked (DeepSpeed's own are Adams)
        self._state_bytes: Callable[[torch.dtype], float] | None = None

    # -- settings derived from the config -------------------------------------------------------------------
    @property
    def stage(self) -> int:
        return int(self.config["zero_optimization"]["stage"])

    @property
    def offload_optimizer(self) -> bool:
        return bool(self.config["zero_optimization"].get("offload_optimizer"))

    @property
    def offload_parameters(self) -> bool:
        return bool(self.config["zero_optimization"].get("offload_param"))

    # -- precision: take over any plugin that names a Lightning precision literal ----------------------------
    @property
    @override
    def precision_plugin(self) -> Precision:
        return pl_compat.get_precision_plugin(self)

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None and not isinstance(plugin, DeepSpeedPrecision):
            literal = getattr(plugin, "precision", None)
            if literal in modes.TABLE:  # DeepSpeed's bf16 is bf16-master: bf16 module, float32 masters in ZeRO
                literal = modes.spec(literal).deepspeed_as
            if literal not in PRECISIONS:
                raise ValueError(f"ZeroStrategy needs a precision plugin whose .precision is one of {PRECISIONS}, "
                                 f"got {type(plugin).__name__} with precision={literal!r}")
            self._source_precision = plugin
            guarded = getattr(plugin, "on_nonfinite", None) not in (None, "ignore") and not _fp16(literal)
            plugin = GuardedDeepSpeedPrecision(literal, plugin) if guarded else DeepSpeedPrecision(literal)
        pl_compat.set_precision_plugin(self, plugin)

    def _apply_source_precision(self) -> None:
        """fp16 loss-scale settings from the source plugin's ``scaler_config``; its non-finite policy checked."""
        source, literal = self._source_precision, self.precision_plugin.precision
        if source is None:
            return
        if _fp16(literal) and "fp16" not in self.config:
            self.config["fp16"] = fp16_section(getattr(source, "scaler_config", None))
        policy = getattr(source, "on_nonfinite", None)
        if policy in (None, "ignore") or policy in _HONOURED_NONFINITE.get(literal, ()):
            return
        if _fp16(literal):
            raise ValueError(f"on_nonfinite={policy!r} cannot be honoured by ZeroStrategy with precision={literal!r}:"
                             " DeepSpeed's fp16 loss scaler always skips the step; set on_nonfinite='skip'")
        rank_zero_warn(f"on_nonfinite={policy!r} is not applied under ZeroStrategy with precision={literal!r}: a "
                       "DeepSpeed engine cannot change precision or stop mid-step, so non-finite steps are skipped "
                       "instead (discarded by DeepSpeed, counted in skipped_steps). Set on_nonfinite='skip'.")

    # -- CPU support: the three points where Lightning's DeepSpeedStrategy assumes CUDA ---------------------
    @override
    def setup_environment(self) -> None:
        on_cpu = isinstance(self.accelerator, CPUAccelerator)
        if not on_cpu and not isinstance(self.accelerator, CUDAAccelerator):
            raise RuntimeError(f"ZeroStrategy runs on CPUAccelerator or CUDAAccelerator, got "
                               f"{type(self.accelerator).__name__}")
        check_precision(self.precision_plugin.precision, "cpu" if on_cpu else "cuda")
        # DeepSpeed may have fixed its accelerator at import, from DS_ACCELERATOR; the device decides here
        if use_deepspeed_accelerator("cpu" if on_cpu else "cuda"):
            rank_zero_info(f"ZeroStrategy: DeepSpeed accelerator set to {'cpu' if on_cpu else 'cuda'} for this run")
        self._deepspeed_patches.enter_context(ds_compat.memory_readers_follow_accelerator())
        self._apply_source_precision()
        # skip DeepSpeedStrategy's CUDA-only check; the rest of the environment setup is DDP's
        pl_compat.setup_environment_as_ddp(self)

    @override
    def setup_distributed(self) -> None:
        if isinstance(self.accelerator, CUDAAccelerator):
            super().setup_distributed()
            return
        # as DeepSpeedStrategy.setup_distributed, without its device-index check (CPU devices have no index)
        reset_seed()
        self.set_world_ranks()
        with nullcontext() if self.build_shm_comm else ds_compat.shm_comm_build_skipped():
            ds_compat.init_deepspeed_distributed(self)

    def _adjust_initialize(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        optimizer = kwargs.get("optimizer")
        if optimizer is not None:
            check_zero_optimizer(optimizer)
            check_offload_optimizer(optimizer, self.offload_optimizer)
            if state_bytes_per_param(optimizer) is not None:
                self._state_bytes = functools.partial(state_bytes_per_param, optimizer)
        if isinstance(self.accelerator, CPUAccelerator):
            kwargs = ds_compat.with_device_rank(kwargs, self.local_rank)
        return kwargs

    @override
    def init_deepspeed(self) -> None:
        with ds_compat.intercept_deepspeed_initialize(self._adjust_initialize):
            super().init_deepspeed()
        self._log_estimate()  # the optimizer has been asked its state (in _adjust_initialize)

    # -- gradient accumulation: Lightning decides, DeepSpeed follows ---------------------------------------
    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # Lightning already divided the loss by accumulate_grad_batches; DeepSpeed would divide it again
        # (Lightning #6170), which shrinks every accumulated gradient by the factor.
        kwargs.setdefault("scale_wrt_gas", False)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.sync_accumulation(self.lightning_module.trainer)

    def sync_accumulation(self, trainer: "pl.Trainer") -> None:
        """Set the DeepSpeed engine's accumulation steps and boundary from the trainer's current decision.

        The decision comes from the :class:`~lit_speed.interfaces.AccumulationDecider` among the trainer's
        callbacks (e.g. ``AccumulationScheduler``, which decides in its ``on_train_batch_start``, before this
        runs), else from Lightning's own ``batch % accumulate_grad_batches`` rule.
        """
        set_accumulation(self.deepspeed_engine, trainer.accumulate_grad_batches)
        decider = find_accumulation_decider(trainer.callbacks)
        steps = decider.optimizer_steps_now() if decider is not None else not pl_compat.should_accumulate(trainer)
        self.deepspeed_engine.set_gradient_accumulation_boundary(steps)

    def scale_step_gradients(self, scale: float) -> None:
        """Multiply the gradients the next optimizer step applies by ``scale`` (1.0: plain steps again).

        ZeRO keeps gradients in flat partitions and divides them by its loss scale when it steps, so the scale rides
        on that (:class:`~lit_speed.interfaces.AccumulationFollower`: ``AccumulationScheduler`` normalises a window
        through it).

        Raises:
            ValueError: When DeepSpeed's optimizer cannot take a fixed loss scale (fp16's dynamic loss scaler, or a
                non-ZeRO DeepSpeed optimizer).
        """
        optimizer = self.deepspeed_engine.optimizer
        if not hasattr(optimizer, "override_loss_scale") or getattr(optimizer, "dynamic_loss_scale", False):
            raise ValueError(f"AccumulationScheduler normalises ZeRO gradients through the loss scale of "
                             f"DeepSpeed's ZeRO optimizer; {type(optimizer).__name__} (dynamic fp16 loss scaling "
                             f"or a non-ZeRO DeepSpeed optimizer) cannot; use precision 'bf16-mixed' or '32-true'")
        optimizer.override_loss_scale(1.0 / scale)

    # -- checkpoint parts without collectives (lit_speed.interfaces.PartwiseCheckpointWriter) ------------------
    def module_state_for_checkpoint(self) -> dict:
        """The module state the model-states file of a checkpoint holds (live tensors)."""
        return self.deepspeed_engine.module_state_dict()

    def write_optimizer_part(self, folder: str) -> None:
        """This process's optimizer shard of checkpoint ``folder``, as ``save_checkpoint`` writes it (no barrier)."""
        ds_compat.write_zero_optimizer_part(self.deepspeed_engine, folder, ds_compat.zero_checkpoint_tag())

    def write_model_states(self, folder: str, module_state: dict, client_state: dict) -> bool:
        """The model-states file of ``folder`` (on the process DeepSpeed writes it from); ``latest`` is the caller's."""
        engine = self.deepspeed_engine
        if not engine.save_non_zero_checkpoint:
            return False
        ds_compat.write_zero_model_states(engine, folder, ds_compat.zero_checkpoint_tag(), module_state, client_state)
        return True

    @override
    def teardown(self) -> None:
        self._deepspeed_patches.close()
        super().teardown()

    # -- checkpoints -----------------------------------------------------------------------------------------
    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if not (self.load_full_weights and self.zero_stage_3):
            check_resume_world_size(checkpoint_path, self.world_size)
        return super().load_checkpoint(checkpoint_path, weights_only)

    # -- reporting -----------------------------------------------------------------------------------------
    def memory_estimate(self, num_params: int, stage: int | None = None, frozen_params: int = 0) -> ModelStateBytes:
        """Per-rank bytes of model states for this stage (or ``stage``: 0 for DeepSpeed without ZeRO, on one rank),
        offload, precision and world size; ``frozen_params`` (a frozen base under adapters) take parameter memory
        on every rank (sharded at stage 3) but no gradient or optimizer state."""
        precision = self.precision_plugin.precision
        if stage is not None:
            return model_state_bytes(num_params, precision, layout=ZeroLayout(stage, deepspeed=True),
                                     frozen_params=frozen_params, state_bytes=self._state_bytes)
        layout = ZeroLayout(self.stage, self.offload_optimizer, self.offload_parameters, deepspeed=True)
        return model_state_bytes(num_params, precision, layout=layout, world_size=self.world_size,
                                 frozen_params=frozen_params, state_bytes=self._state_bytes)

    def _log_estimate(self) -> None:
        module = self.lightning_module
        if module is None:
            return
        n, frozen = parameter_counts(module)  # every rank holds the frozen ones too
        self._estimate = est = self.memory_estimate(n, frozen_params=frozen)
        rank_zero_info(f"ZeRO-{self.stage} model states per rank: params {format_bytes(est.params)}, grads "
                       f"{format_bytes(est.grads)}, optimizer {format_bytes(est.optimizer)} "
                       f"({format_bytes(est.host)} in host RAM)")

    def describe(self, model: torch.nn.Module | None = None) -> dict[str, str]:
        """Rows for the start-up table: stage/offload and the per-rank model-state estimate vs plain DDP."""
        offload = [name for name, on in (("optimizer", self.offload_optimizer),
                                         ("parameters", self.offload_parameters)) if on]
        rows = {"zero": f"stage {self.stage}, offload: {', '.join(offload) or 'none'}, "
                        f"{self.world_size} rank(s), {self.precision_plugin.precision}"}
        model = model if model is not None else self.lightning_module
        if model is not None:
            n, frozen = parameter_counts(model)
            est, ddp = self.memory_estimate(n, frozen_params=frozen), self.memory_estimate(n, 0, frozen)
            counted = f"{n:,} trainable + {frozen:,} frozen parameters: " if frozen else ""
            rows["zero model states / rank"] = (
                f"{counted}params {format_bytes(est.params)} + grads {format_bytes(est.grads)} + optimizer "
                f"{format_bytes(est.optimizer)} = {format_bytes(est.total)} "
                f"({format_bytes(est.host)} in host RAM; DDP: {format_bytes(ddp.total)})")
        else:
            est, ddp = self.memory_estimate(1_000_000), self.memory_estimate(1_000_000, stage=0)
            rows["zero model states / rank"] = (f"{est.total / 1e6:.2f} bytes/param "
                                                f"({est.host / 1e6:.2f} in host RAM; DDP: "
                                                f"{ddp.total / 1e6:.2f})")
        if self._source_precision is not None:
            source = getattr(self._source_precision, "precision", "")
            rows["zero precision"] = (f"{type(self._source_precision).__name__} -> DeepSpeed "
                                      f"{self.precision_plugin.precision}" + (
                                          " (DeepSpeed's bf16: a bf16 module with float32 master weights and optimizer "
                                          "state in the ZeRO optimizer, i.e. bf16-master)"
                                          if source in modes.TABLE and modes.spec(source).master_weights
                                          else ""))
        return rows

    def final_summary(self) -> dict[str, Any]:
        """Stage, offload, estimated and measured per-rank optimizer state, skipped steps, engine accumulation."""
        summary: dict[str, Any] = {"stage": self.stage, "offload_optimizer": self.offload_optimizer,
                                   "offload_parameters": self.offload_parameters, "world_size": self.world_size}
        if self._estimate is not None:
            summary["estimated_optimizer_state_bytes_per_rank"] = self._estimate.optimizer
        if self.optimizers:
            summary["measured_optimizer_state_bytes_rank0"] = measured_optimizer_state_bytes(self.optimizers[0])
        engine = self.model
        if hasattr(engine, "skipped_steps"):
            summary["skipped_steps"] = int(engine.skipped_steps)
            summary["gradient_accumulation_steps"] = int(engine.gradient_accumulation_steps())
        return summary


def _fp16(literal: str) -> bool:
    """DeepSpeed runs ``literal`` in fp16 (its own loss scaler, refused on the CPU accelerator)."""
    return modes.compute_dtype(literal) == torch.float16


def set_accumulation(engine: Any, factor: int) -> None:
    """Change a DeepSpeed engine's gradient-accumulation steps at run time (keeps the micro-batch size).

    ``DeepSpeedEngine.set_train_batch_size`` rewrites ``gradient_accumulation_steps`` in its config; the ZeRO
    optimizer keeps its own copy (used for CPU-offload accumulation buffers), updated here as well.
    """
    if engine.gradient_accumulation_steps() == factor:
        return
    engine.set_train_batch_size(engine.train_micro_batch_size_per_gpu() * factor * engine.dp_world_size)
    if hasattr(engine.optimizer, "gradient_accumulation_steps"):
        engine.optimizer.gradient_accumulation_steps = factor


def _read_config(config: Mapping[str, Any] | str | Path | None) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, (str, Path)):
        if not os.path.isfile(config):
            raise ValueError(f"ZeroStrategy(config=...) path does not exist: {config}; pass a JSON file or a dict")
        return json.loads(Path(config).read_text())
    try:  # a Hydra DictConfig: plain containers, interpolations resolved
        from omegaconf import OmegaConf

        if OmegaConf.is_config(config):
            return OmegaConf.to_container(config, resolve=True)  # type: ignore[return-value]
    except ImportError:  # pragma: no cover - omegaconf ships with hydra
        pass
    return dict(config)


