"""Fail loudly when Lightning, DeepSpeed or torch change a private name ``lit_speed.compat`` relies on.

``lit_speed/compat/`` is the only place lit_speed touches private names of these libraries (written against
Lightning 2.6.6, DeepSpeed 0.19.8, torch 2.13; ``tests/test_architecture.py`` keeps it so). Each test here
names the private name and the compat helper to revisit when it fails: after a library upgrade, run this
file first, re-read the named method in the new version, and update the helper and its test together.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import os
from typing import Any

import lightning
import lightning.pytorch as pl
import pytest
import torch
from torch import nn

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.core.optimizer import LightningOptimizer  # noqa: E402
from lightning.pytorch.loops.fetchers import _DataFetcher, _PrefetchDataFetcher  # noqa: E402
from lightning.pytorch.loops.fit_loop import _FitLoop  # noqa: E402
from lightning.pytorch.loops.optimization.automatic import ClosureResult, _AutomaticOptimization  # noqa: E402
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop  # noqa: E402
from lightning.pytorch.plugins.precision import Precision  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, Strategy  # noqa: E402
from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lit_speed.compat as compat  # noqa: E402
from lit_speed.accumulation import AccumulationScheduler  # noqa: E402
from lit_speed.checkpointing.preemption import request_stop  # noqa: E402
from lit_speed.compat import deepspeed as ds_compat  # noqa: E402
from lit_speed.compat import lightning as pl_compat
from lit_speed.compat import torch as torch_compat
from lit_speed.compat.lightning_data import (  # noqa: E402
    call_before_each_unsized_fetch,
    recreate_train_iterator,
    train_iterator_exists,
)
from lit_speed.data.digits import DigitsDataModule  # noqa: E402
from lit_speed.models.mlp import MLPClassifier  # noqa: E402


def _source(fn: Any) -> str:
    return "".join(inspect.getsource(fn).split())  # whitespace-insensitive


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(module: pl.LightningModule, loader: Any, callbacks: list[Callback], **kwargs: Any) -> pl.Trainer:
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, max_epochs=1, callbacks=callbacks,
                         **kwargs)
    trainer.fit(module, loader)
    return trainer


def _tiny_loader(n: int = 16, batch_size: int = 8) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 4, generator=generator), torch.randint(0, 2, (n,), generator=generator))
    return DataLoader(data, batch_size=batch_size)


# ---------------------------------------------------------------------------------------------- versions
def test_lightning_version_is_the_one_the_helpers_were_written_for() -> None:
    major_minor = ".".join(lightning.__version__.split(".")[:2])
    assert major_minor == ".".join(compat.LIGHTNING_VERSION.split(".")[:2]), (
        f"Lightning {lightning.__version__} installed; lit_speed/compat was written against "
        f"{compat.LIGHTNING_VERSION}: re-check every helper in it, then update LIGHTNING_VERSION")


def test_deepspeed_and_torch_versions_are_the_ones_the_helpers_were_written_for() -> None:
    import deepspeed

    assert _major_minor(deepspeed.__version__) == _major_minor(compat.DEEPSPEED_VERSION), (
        f"DeepSpeed {deepspeed.__version__} installed; lit_speed/compat/deepspeed.py was written against "
        f"{compat.DEEPSPEED_VERSION}: re-check it, then update DEEPSPEED_VERSION")
    assert _major_minor(torch.__version__) == _major_minor(compat.TORCH_VERSION), (
        f"torch {torch.__version__} installed; lit_speed/compat/torch.py was written against "
        f"{compat.TORCH_VERSION}: re-check it, then update TORCH_VERSION")


# ---------------------------------------------------------------------------------------------- compat.lightning
def test_epoch_loop_routes_every_accumulation_decision_through_should_accumulate():
    # install_accumulation_controller(), is_last_batch_of_epoch(): _TrainingEpochLoop._should_accumulate,
    # _num_ready_batches_reached
    assert "self._should_accumulate()" in inspect.getsource(_TrainingEpochLoop.update_lr_schedulers)
    assert "self._should_accumulate()" in inspect.getsource(_TrainingEpochLoop.on_advance_end)
    assert "notaccumulation_doneandstrategy_accumulates_on_final_batch" in _source(_TrainingEpochLoop._should_accumulate)
    assert "epoch_finished_on_ready" in _source(_TrainingEpochLoop._num_ready_batches_reached)


def test_automatic_optimization_decisions_we_replace_are_unchanged():
    # install_accumulation_controller(): zero-grad is decided by the batch index modulo the factor; our copy
    # of _AutomaticOptimization._make_zero_grad_fn replaces only that test
    zero = _source(_AutomaticOptimization._make_zero_grad_fn)
    assert "is_first_batch_to_accumulate=batch_idx%self.trainer.accumulate_grad_batches==0" in zero
    assert "self._on_before_zero_grad(optimizer)" in zero and "self._optimizer_zero_grad(batch_idx,optimizer)" in zero
    assert "ifself._skip_backward:" in zero
    run = _source(_AutomaticOptimization.run)
    assert "self.trainer.fit_loop._should_accumulate()" in run
    assert "_block_parallel_sync_behavior(self.trainer.strategy,block=True)" in run  # DDP no_sync on accumulation
    assert list(inspect.signature(_AutomaticOptimization.run).parameters) == ["self", "optimizer", "batch_idx", "kwargs"]
    # the loss is divided by accumulate_grad_batches, which on_before_backward's weight undoes
    assert "trainer.accumulate_grad_batches)" in _source(_AutomaticOptimization._training_step)
    assert "closure_loss=closure_loss/normalize" in _source(ClosureResult.from_training_step_output)


def test_validation_after_a_batch_is_still_decided_by_val_check_batch_modulo_the_batch_count():
    # validate_after_this_batch() (ValidateEveryNSteps): _TrainingEpochLoop._should_check_val_fx, after
    # on_train_batch_end, tests (current_iteration + 1) % trainer.val_check_batch with these counters
    check = _source(_TrainingEpochLoop._should_check_val_fx)
    assert "is_val_check_batch=(current_iteration+1)%self.trainer.val_check_batch==0" in check
    assert ("current_iteration=self.total_batch_idxifself.trainer.check_val_every_n_epochisNoneelseself.batch_idx"
            in check)
    advance = _source(_TrainingEpochLoop.advance)
    assert advance.index('"on_train_batch_end"') < len(advance)  # the hook runs inside advance, before on_advance_end
    assert "should_check_val=self._should_check_val_fx(data_fetcher)" in _source(_TrainingEpochLoop.on_advance_end)


def test_install_shadows_instance_methods_only_and_uninstall_restores_them():
    trainer = _fit(_Tiny(), _tiny_loader(16, 8), [AccumulationScheduler(factors={0: 2})])
    epoch_loop = trainer.fit_loop.epoch_loop
    assert "_should_accumulate" not in vars(epoch_loop)
    assert not {"run", "_make_zero_grad_fn"} & set(vars(epoch_loop.automatic_optimization))
    assert type(epoch_loop)._should_accumulate is _TrainingEpochLoop._should_accumulate


def test_should_accumulate_helper_target_exists() -> None:
    assert callable(getattr(_FitLoop, "_should_accumulate", None)), "should_accumulate(): fit_loop._should_accumulate gone"


def test_logger_cadence_is_read_from_the_logger_connector() -> None:
    # step_metrics_written_now(): trainer._logger_connector.should_update_logs
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert isinstance(trainer._logger_connector, _LoggerConnector), "step_metrics_written_now(): connector moved"
    assert isinstance(inspect.getattr_static(_LoggerConnector, "should_update_logs"), property)
    assert pl_compat.step_metrics_written_now(trainer) in (True, False)


def test_request_stop_uses_lightnings_sigterm_flag():
    # request_stop() writes trainer._signal_connector.received_sigterm: fail loudly if Lightning renames it
    for stop in (request_stop, pl_compat.request_stop):
        trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
        assert trainer.received_sigterm is False
        stop(trainer)
        assert trainer.received_sigterm is True


def test_module_trainer_link_is_the_private_trainer_attribute() -> None:
    # attached_trainer(), detached_from_trainer(): LightningModule._trainer backs the public .trainer
    module = _Tiny()
    assert "self._trainer" in inspect.getsource(type(module).trainer.fget), "attached_trainer(): _trainer moved"
    assert pl_compat.attached_trainer(module) is None
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    module.trainer = trainer
    assert pl_compat.attached_trainer(module) is trainer
    with pl_compat.detached_from_trainer(module):
        assert pl_compat.attached_trainer(module) is None
    assert module.trainer is trainer


def test_muted_log_shadows_and_restores_the_log_method() -> None:
    module = _Tiny()
    module.trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(Exception, match="self.log"):  # outside a loop Lightning refuses self.log
        module.log("x", 1.0)
    with pl_compat.muted_log(module):
        module.log("x", 1.0)
    assert "log" not in vars(module)


def test_the_one_private_lightning_call_still_has_the_shape_it_was_written_against() -> None:
    # run_before_step_hooks_and_clipping(): GuardedPrecision runs Lightning's on_before_optimizer_step hooks and
    # clipping through Precision._after_closure(model, optimizer) (Lightning 2.6.6); a change must fail here, loudly
    assert list(inspect.signature(Precision._after_closure).parameters) == ["self", "model", "optimizer"]
    source = inspect.getsource(Precision._after_closure)
    assert "on_before_optimizer_step" in source and "_clip_gradients" in source


def test_lightning_optimizer_keeps_the_wrapped_optimizer() -> None:
    # wrapped_optimizer(): .optimizer, else ._optimizer
    inner = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    wrapper = LightningOptimizer(inner)
    assert wrapper._optimizer is inner and pl_compat.wrapped_optimizer(wrapper) is inner
    assert pl_compat.wrapped_optimizer(inner) is None


def test_precision_plugin_is_a_property_with_a_setter() -> None:
    # get_precision_plugin()/set_precision_plugin() call Strategy's property directly: nothing in between may
    # override it
    prop = inspect.getattr_static(Strategy, "precision_plugin")
    assert isinstance(prop, property) and prop.fset is not None
    for cls in DeepSpeedStrategy.__mro__[:DeepSpeedStrategy.__mro__.index(Strategy)]:
        assert "precision_plugin" not in vars(cls), f"{cls.__name__} now overrides precision_plugin"


def test_lightning_still_checks_cuda_in_setup_environment() -> None:
    # setup_environment_as_ddp(): ZeroStrategy.setup_environment skips DeepSpeedStrategy's body by calling DDPStrategy's
    source = inspect.getsource(DeepSpeedStrategy.setup_environment)
    assert "CUDAAccelerator" in source and "super().setup_environment()" in source
    assert DeepSpeedStrategy.__mro__[1] is DDPStrategy


# ---------------------------------------------------------------------------------------------- compat.lightning_data
def test_train_iterator_helpers_follow_lightnings_fit_loop(tmp_path):
    # FaultTolerance rebuilds the training iterator when DeepSpeed restores the RNG states after it was made;
    # this fails loudly if Lightning moves the fit loop's iterator (train_iterator_exists())
    seen: dict[str, object] = {}

    class Probe(Callback):
        def setup(self, trainer, pl_module, stage):
            seen["at setup"] = train_iterator_exists(trainer)

        def on_train_start(self, trainer, pl_module):
            seen["at train start"] = train_iterator_exists(trainer)
            loader = trainer.fit_loop._data_fetcher.combined_loader
            before = loader._iterator
            recreate_train_iterator(trainer)
            seen["rebuilt"] = loader._iterator is not before

    pl.seed_everything(0)
    trainer = pl.Trainer(accelerator="cpu", callbacks=[Probe()], logger=False, max_steps=2, limit_val_batches=0,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(MLPClassifier(hidden=8, depth=1, optimizer=lambda p: torch.optim.SGD(p, lr=0.1)),
                datamodule=DigitsDataModule(batch_size=32))
    assert seen == {"at setup": False, "at train start": True, "rebuilt": True}
    assert trainer.global_step == 2


def test_fetcher_details_the_data_helpers_use() -> None:
    # call_before_each_unsized_fetch(): the epoch loop hands _on_before_fetch to the fetcher
    assert "self._on_before_fetch" in inspect.getsource(_TrainingEpochLoop), "_on_before_fetch moved"
    assert "_data_fetcher" in inspect.getsource(_FitLoop.__init__) and "_data_source" in inspect.getsource(
        _FitLoop.__init__), "fit_loop._data_fetcher / _data_source moved"
    # prefetched_batches(), redraw_prefetched_batch(): the prefetching fetcher's queue and counter
    fetcher = _PrefetchDataFetcher()
    assert isinstance(fetcher.batches, list) and fetcher.fetched == 0 and fetcher.length is None
    assert hasattr(fetcher, "iterator"), "train_iterator_exists(): _DataFetcher.iterator moved"
    assert "self.fetched+=1" in _source(_DataFetcher.__next__) and "self.batches.pop(0)" in _source(
        _PrefetchDataFetcher.__next__)


def test_restart_at_an_epochs_last_batch_is_read_as_fit_loop_reset_reads_it() -> None:
    # restarted_after_an_epochs_last_batch(): FitLoop.reset counts the epoch done on exactly this condition,
    # and set_train_sampler_epoch() uses the function FitLoop.on_advance_start calls
    reset = _source(_FitLoop.reset)
    assert ("self.epoch_loop.restarted_on_train_batch_end" in reset and "self.restarted_mid_epoch" in reset
            and "self.epoch_loop.batch_progress.is_last_batch" in reset), "FitLoop.reset's last-batch case changed"
    assert "_set_sampler_epoch(dl,self.epoch_progress.current.processed)" in _source(_FitLoop.on_advance_start)
    from lightning.fabric.utilities.data import _set_sampler_epoch  # noqa: F401  (set_train_sampler_epoch)


def test_snapshot_runs_before_each_unsized_fetch_and_installs_once() -> None:
    class Endless(torch.utils.data.IterableDataset):
        def __iter__(self):
            g = torch.Generator().manual_seed(0)
            while True:
                yield torch.randn(4, generator=g), torch.randint(0, 2, (), generator=g)

    calls: list[int] = []

    class Install(Callback):
        def on_train_start(self, trainer, pl_module):
            for _ in range(2):  # the second install is refused: one wrapper per loop
                call_before_each_unsized_fetch(trainer, lambda: calls.append(trainer.global_step))

    _fit(_Tiny(), DataLoader(Endless(), batch_size=4), [Install()], max_steps=3)
    # once per fetch after on_train_start (the first batch was prefetched before it), not twice
    assert calls == [0, 1, 2]


def test_auto_micro_batch_size_replaces_lightnings_private_hook() -> None:
    # BatchSizeFromLoader overrides DeepSpeedStrategy._auto_select_batch_size and reads fit_loop._data_source
    source = inspect.getsource(DeepSpeedStrategy._format_batch_size_and_grad_accum_config)
    assert "self._auto_select_batch_size()" in source, "ZeroStrategy._auto_select_batch_size is no longer called"
    assert "fit_loop._data_source" in inspect.getsource(DeepSpeedStrategy._auto_select_batch_size)
    assert "_auto_select_batch_size" in vars(ds_compat.BatchSizeFromLoader)


# ---------------------------------------------------------------------------------------------- compat.deepspeed
def test_init_deepspeed_distributed_helper_target_exists() -> None:
    source = inspect.getsource(DeepSpeedStrategy._init_deepspeed_distributed)
    assert "deepspeed.init_distributed" in source, "init_deepspeed_distributed(): Lightning changed the method"


def test_lightning_still_passes_the_device_index_as_device_rank() -> None:
    # intercept_deepspeed_initialize()/with_device_rank() amend exactly this call
    for method in (DeepSpeedStrategy._setup_model_and_optimizer, DeepSpeedStrategy._initialize_deepspeed_inference):
        source = inspect.getsource(method)
        assert "deepspeed.initialize(" in source and "device_rank=self.root_device.index" in source, method
        assert "import deepspeed" in source, "the patch relies on a function-local `import deepspeed`"


def test_shm_patch_reaches_the_module_deepspeed_calls_and_is_scoped() -> None:
    module = importlib.import_module("deepspeed.comm.torch")
    assert "build_shm_op()" in inspect.getsource(module.TorchBackend.__init__), "shm_comm_build_skipped(): target moved"
    original = module.build_shm_op
    try:
        with ds_compat.shm_comm_build_skipped():
            assert module.build_shm_op() is None
        assert module.build_shm_op is original, "shm_comm_build_skipped() must restore DeepSpeed's build_shm_op"
    finally:
        module.build_shm_op = original


def test_memory_readers_follow_the_accelerator_inside_the_block_and_are_restored() -> None:
    from deepspeed.accelerator import get_accelerator

    utils = importlib.import_module("deepspeed.runtime.utils")
    assert "torch_memory_reserved()" in inspect.getsource(utils.see_memory_usage), "DeepSpeed's memory readers moved"
    originals = utils.torch_memory_reserved, utils.torch_max_memory_reserved
    with ds_compat.memory_readers_follow_accelerator():
        assert utils.torch_memory_reserved.__self__ is get_accelerator()
        assert utils.torch_max_memory_reserved.__self__ is get_accelerator()
    assert (utils.torch_memory_reserved, utils.torch_max_memory_reserved) == originals


def test_intercept_amends_device_rank_and_restores_deepspeed_initialize() -> None:
    import deepspeed

    original = deepspeed.initialize
    seen = {}

    def adjust(kwargs):
        seen.update(ds_compat.with_device_rank(kwargs, 3))
        raise RuntimeError("stop before the engine is built")

    with ds_compat.intercept_deepspeed_initialize(adjust), pytest.raises(RuntimeError, match="stop before"):
        deepspeed.initialize(args=argparse.Namespace(device_rank=None), config={})
    assert seen["args"].device_rank == 3
    assert deepspeed.initialize is original
    kept = ds_compat.with_device_rank({"args": argparse.Namespace(device_rank=0)}, 3)
    assert kept["args"].device_rank == 0  # a real device index (CUDA) is left alone


# ---------------------------------------------------------------------------------------------- compat.torch
def test_foreach_ops_exist_and_act_in_place() -> None:
    a, b = torch.ones(3), torch.full((2,), 2.0)
    torch_compat.foreach_mul_([a, b], 3.0)
    assert a.tolist() == [3.0] * 3 and b.tolist() == [6.0] * 2
    target = torch.zeros(2, dtype=torch.bfloat16)
    torch_compat.foreach_copy_([target], [torch.tensor([1.5, -2.0])])
    assert target.dtype == torch.bfloat16 and target.tolist() == [1.5, -2.0]


def test_foreach_max_abs_propagates_nan_and_inf_and_sparse_values_are_the_stored_ones() -> None:
    # foreach_max_abs: torch._foreach_norm(ord=inf); sparse_values: Tensor._values() (COO) / values() (compressed)
    tensors = [torch.tensor([1.0, -3.0]), torch.tensor([2.0, float("nan")]), torch.tensor([float("-inf")]),
               torch.tensor([0.5], dtype=torch.bfloat16)]
    top = [torch_compat.foreach_max_abs([t])[0] for t in tensors]
    assert top[0].item() == 3.0 and top[1].isnan() and top[2].item() == float("inf") and top[3].dtype == torch.bfloat16
    assert [t.item() for t in torch_compat.foreach_max_abs(tensors[:1] * 2)] == [3.0, 3.0]
    coo = torch.sparse_coo_tensor([[0, 0]], [1.0, 2.0], (3,))  # uncoalesced: two stored values at one index
    assert torch_compat.sparse_values(coo).tolist() == [1.0, 2.0]
    assert torch_compat.sparse_values(torch.eye(2).to_sparse_csr()).tolist() == [1.0, 1.0]


def test_a_dtype_cast_reaches_a_dispatch_mode_as_the_cast_op() -> None:
    # CAST_OP: torch.ops.aten._to_copy.default, what SkipMatmuls recognises a weight's .to(bf16) by
    seen = []

    class Record(torch_compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Record():
        torch.ones(2).to(torch.bfloat16)
    assert torch_compat.CAST_OP in seen


def test_mkldnn_bf16_check_is_still_an_op() -> None:
    # cpu_has_native_bf16(): torch.ops.mkldnn._is_mkldnn_bf16_supported (a build without mkldnn answers False)
    if torch.backends.mkldnn.is_available():
        assert isinstance(torch.ops.mkldnn._is_mkldnn_bf16_supported(), bool)
    assert torch_compat.cpu_has_native_bf16() in (True, False)


def test_pytree_and_dispatch_mode_names() -> None:
    # tree_leaves/tree_map (torch.utils._pytree) and TorchDispatchMode (torch.utils._python_dispatch)
    nested = {"a": (torch.ones(1), [torch.zeros(2)]), "b": 3}
    assert [t.numel() for t in torch_compat.tree_leaves(nested) if isinstance(t, torch.Tensor)] == [1, 2]
    doubled = torch_compat.tree_map(lambda v: v * 2 if isinstance(v, torch.Tensor) else v, nested)
    assert doubled["a"][0].item() == 2.0 and doubled["b"] == 3
    assert inspect.isclass(torch_compat.TorchDispatchMode) and hasattr(torch_compat.TorchDispatchMode, "__enter__")


def test_in_place_compile_uses_compiled_call_impl() -> None:
    # is_compiled()/uncompile(): nn.Module.compile() sets the private `_compiled_call_impl`
    module = nn.Linear(2, 2)
    assert module._compiled_call_impl is None and not torch_compat.is_compiled(module)
    module.compile(backend="eager")
    assert module._compiled_call_impl is not None and torch_compat.is_compiled(module)
    torch_compat.uncompile(module)
    assert not torch_compat.is_compiled(module)


def test_torch_compile_returns_the_optimized_module_wrapper() -> None:
    # is_compiled_wrapper(): torch._dynamo.eval_frame.OptimizedModule
    from torch._dynamo.eval_frame import OptimizedModule

    wrapped = torch.compile(nn.Linear(2, 2), backend="eager")
    assert isinstance(wrapped, OptimizedModule) and torch_compat.is_compiled_wrapper(wrapped)
    assert not torch_compat.is_compiled_wrapper(nn.Linear(2, 2))


# ---------------------------------------------------------------------------------------------- compat.hydra
def test_hydra_version_is_the_one_the_helpers_were_written_for() -> None:
    import hydra

    from lit_speed.compat import hydra as hydra_compat

    assert _major_minor(hydra.__version__) == _major_minor(hydra_compat.HYDRA_VERSION), (
        f"hydra-core {hydra.__version__} installed; lit_speed/compat/hydra.py was written against "
        f"{hydra_compat.HYDRA_VERSION}: re-check it against hydra._internal.utils._run_hydra, then update HYDRA_VERSION")


def test_hydra_main_still_builds_its_search_path_the_way_the_preflight_copies() -> None:
    # initialized_like_main copies these steps of hydra._internal.utils._run_hydra: the automatic search path from
    # the calling file and config_path, then --config-dir prepended before the schema source
    from hydra._internal.utils import _run_hydra

    source = _source(_run_hydra)
    assert "create_automatic_config_search_path(calling_file,calling_module,config_path)" in source
    assert 'search_path.prepend(provider="command-line",path=f"file://{abs_config_dir}",' \
           'anchor=SearchPathQuery(provider="schema"),)' in source
    assert "Hydra.create_main_hydra2(task_name=task_name,config_search_path=search_path)" in source


def test_hydra_parser_reads_the_flags_the_preflight_needs(tmp_path) -> None:
    from lit_speed.compat.hydra import initialized_like_main, parse_command_line

    args, unrecognized = parse_command_line(["-m", "--config-dir=my_conf", "-cn", "mine", "--config-path", "/abs",
                                             "a=1", "--cfg", "job", "b=2"])
    assert (args.config_dir, args.config_name, args.config_path, args.overrides, args.multirun) == \
           ("my_conf", "mine", "/abs", ["a=1"], True)
    assert unrecognized == ["b=2"]  # @hydra.main refuses it: "unrecognized arguments"
    (tmp_path / "extra" / "model").mkdir(parents=True)
    (tmp_path / "extra" / "model" / "mine.yaml").write_text("_target_: x.Y\n")
    from hydra import compose
    from hydra.core.global_hydra import GlobalHydra

    with initialized_like_main(str(tmp_path / "train.py"), "main_conf", str(tmp_path / "extra")):
        (tmp_path / "main_conf").mkdir()
        (tmp_path / "main_conf" / "train.yaml").write_text("defaults:\n  - model: mine\n")
        sources = compose("train", return_hydra_config=True).hydra.runtime.config_sources
        assert [(s.provider, s.path) for s in sources if s.schema == "file"] == [
            ("main", str(tmp_path / "main_conf")), ("command-line", str(tmp_path / "extra"))]
    assert not GlobalHydra.instance().is_initialized()  # restored as it was


# ---------------------------------------------------------------------------------------------- compat.lightning_loops
def test_signal_connector_and_stop_broadcast_names_the_stop_helpers_replace() -> None:
    # replace_sigterm_notifier(), replace_stop_broadcast(), set_received_sigterm(), training_done_after_this_batch()
    from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

    register = _source(_SignalConnector.register_signal_handlers)
    assert "sigterm_handlers:list[_HANDLER]=[self._sigterm_notifier_fn]" in register, "the notifier is looked up here"
    assert "dist.broadcast" in _source(_SignalConnector._sigterm_notifier_fn)  # the collective we keep out of handlers
    assert "self._broadcast_sigterm_tensor()" in _source(_TrainingEpochLoop.advance)
    assert "ifnotself._is_training_doneandself.trainer.received_sigterm:" in _source(_TrainingEpochLoop.on_advance_end)
    assert isinstance(inspect.getattr_static(_TrainingEpochLoop, "_is_training_done"), property)
    assert "self._signal_connector.received_sigterm" in _source(pl.Trainer.received_sigterm.fget)


def test_stop_helpers_are_instance_patches_installed_once() -> None:
    from lit_speed.compat import lightning_loops as loops

    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    calls: list[str] = []
    loops.call_after_each_batch(trainer, lambda: calls.append("after"))
    first = trainer.fit_loop.epoch_loop.on_advance_end
    loops.call_after_each_batch(trainer, lambda: calls.append("again"))
    assert trainer.fit_loop.epoch_loop.on_advance_end is first
    loops.replace_stop_broadcast(trainer, lambda: calls.append("decide"))
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
    loops.set_received_sigterm(trainer)
    assert trainer.received_sigterm and calls == ["decide"]
    assert type(trainer.fit_loop.epoch_loop).on_advance_end is _TrainingEpochLoop.on_advance_end  # class untouched


def test_fit_loop_restart_rules_the_epoch_end_fix_relies_on() -> None:
    # resume_finished_epoch_as_new_epoch(): _FitLoop.restarting's setter forces True with max_steps; the base
    # _Loop setter does not; the epoch-based path resumes an epoch-end checkpoint as RESUMED_ON_EPOCH_END
    from lightning.pytorch.loops.loop import _Loop

    assert "orself._iteration_based_training()" in _source(inspect.getattr_static(_FitLoop, "restarting").fset)
    assert "forloopinvars(self).values():" in _source(_Loop.restarting.fset)
    assert "self._loaded_from_state_dict" in _source(_FitLoop.update_restart_stage)
    assert "ifself.resumed_on_epoch_end:" in _source(_FitLoop.reset)


def test_log_rows_are_written_after_the_hooks_a_checkpoint_is_saved_in() -> None:
    # log_row_written_after_this_hook(), in_epoch_end_hooks(): the rows' order relative to the hooks
    from lightning.pytorch.loops.fit_loop import _FitLoop as FitLoop

    advance = _source(_TrainingEpochLoop.advance)
    assert advance.index('"on_train_batch_end"') < advance.index("update_train_step_metrics()")
    end = _source(FitLoop.on_advance_end)
    assert end.index('"on_train_epoch_end"') < end.index("self.epoch_loop._batches_that_stepped-=1") \
        < end.index("update_train_epoch_metrics()")
    assert "self.log_metrics(self.metrics[\"log\"])" in _source(_LoggerConnector.update_train_step_metrics)
    assert "on_step=self._first_loop_iterisnotNone" in _source(inspect.getattr_static(_LoggerConnector, "metrics").fget)


def test_dump_checkpoint_is_what_save_checkpoint_writes() -> None:
    # dump_checkpoint(): trainer._checkpoint_connector.dump_checkpoint(weights_only)
    assert "checkpoint=self._checkpoint_connector.dump_checkpoint(weights_only)" in _source(pl.Trainer.save_checkpoint)


def test_metric_state_restore_sets_the_private_counters() -> None:
    # set_metric_state(): torchmetrics' Metric._update_count and ._computed
    from torchmetrics.classification import MulticlassAccuracy

    from lit_speed.compat.torchmetrics import set_metric_state

    metric = MulticlassAccuracy(3, average="micro")
    metric.update(torch.tensor([0, 1, 2]), torch.tensor([0, 1, 1]))
    saved = {k: v.clone() for k, v in metric.metric_state.items()}
    fresh = MulticlassAccuracy(3, average="micro")
    set_metric_state(fresh, saved, metric.update_count)
    assert fresh.update_count == 1 and torch.equal(fresh.compute(), metric.compute())


def test_deepspeed_checkpoint_part_writers_follow_save_checkpoint() -> None:
    # write_zero_optimizer_part(), write_zero_model_states(): the names save_checkpoint writes its files under
    from deepspeed.runtime.engine import DeepSpeedEngine
    from lightning.pytorch.strategies.deepspeed import DeepSpeedStrategy as LightningDeepSpeed

    zero = _source(DeepSpeedEngine._save_zero_checkpoint)
    assert "zero_checkpoint_name=self._get_zero_ckpt_name(save_path,tag)" in zero
    assert "zero_sd=dict(optimizer_state_dict=self.optimizer.state_dict(),ds_config=self.config,ds_version=version)" in zero
    model = _source(DeepSpeedEngine._save_checkpoint)
    assert "state=self._common_checkpoint_state(module,zero_optimizer_state,save_frozen_param)" in model
    assert "ifself.save_non_zero_checkpoint:" in model
    assert f'tag="{ds_compat.zero_checkpoint_tag()}"' in _source(LightningDeepSpeed.save_checkpoint)


def test_atexit_runs_and_clears_the_hooks_like_the_interpreters_exit() -> None:
    # run_exit_hooks(): atexit._run_exitfuncs runs every hook once, last registered first, and clears them.
    # In a process of its own: here it would run the test session's own exit hooks.
    import subprocess
    import sys

    code = ("import atexit\n"
            "from lit_speed.compat.python import run_exit_hooks\n"
            "atexit.register(print, 'first')\n"
            "atexit.register(print, 'second')\n"
            "run_exit_hooks()\n"
            "print('left', atexit._ncallbacks())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["second", "first", "left 0"]  # and nothing more at the real exit
    assert done.stdout.count("first") == 1


def test_datasets_offline_switch_is_the_module_value_load_dataset_reads(tmp_path) -> None:
    # hub_offline(): datasets.config.HF_HUB_OFFLINE, read when load_dataset resolves a dataset id
    import time

    import datasets
    import datasets.config

    from lit_speed.compat.datasets import hub_offline

    before = datasets.config.HF_HUB_OFFLINE
    start = time.perf_counter()
    with hub_offline(True), pytest.raises(ConnectionError, match="OfflineModeIsEnabled"):
        datasets.load_dataset("nobody/no-such-dataset", cache_dir=str(tmp_path))
    assert time.perf_counter() - start < 10 and datasets.config.HF_HUB_OFFLINE == before


def test_hydra_main_still_composes_in_get_mode_then_in_run() -> None:
    # on_main_composition answers Hydra.get_mode's composition (multirun mode, sweeps not validated) with the run's
    # own, then hands it to Hydra.run, with the hydra.mode=RUN override _run_app adds
    import inspect

    from hydra._internal import utils
    from hydra._internal.hydra import Hydra

    from lit_speed.compat.hydra import MODE_RUN

    get_mode = inspect.getsource(Hydra.get_mode)
    assert "self.compose_config(" in get_mode and "validate_sweep_overrides=False" in get_mode
    assert "RunMode.MULTIRUN" in get_mode
    assert "self.compose_config(" in inspect.getsource(Hydra.run)
    assert f'"{MODE_RUN}"' in inspect.getsource(utils._run_app)
    assert "self.config_loader.load_configuration(" in inspect.getsource(Hydra.compose_config)


# ---------------------------------------------------------------------------------------------- compat.peft
def test_peft_lora_linear_still_has_what_the_hand_merge_reads() -> None:
    pytest.importorskip("peft")
    import peft
    from peft import LoraConfig, get_peft_model

    from lit_speed.compat import peft as peft_compat

    assert _major_minor(peft.__version__) == _major_minor(peft_compat.PEFT_VERSION), (
        f"peft {peft.__version__} installed; lit_speed/compat/peft.py was written against {peft_compat.PEFT_VERSION}")
    model = get_peft_model(torch.nn.Sequential(torch.nn.Linear(4, 3)), LoraConfig(r=2, target_modules=["0"]))
    layer = model.base_model.model[0]
    lora = peft_compat.plain_lora_linear(layer)
    assert lora is not None and lora.adapter == "default" and lora.scaling == 8 / 2 and not lora.fan_in_fan_out
    assert lora.down.weight.shape == (2, 4) and lora.up.weight.shape == (3, 2)
    dora = get_peft_model(torch.nn.Sequential(torch.nn.Linear(4, 3)),
                          LoraConfig(r=2, target_modules=["0"], use_dora=True))
    assert peft_compat.plain_lora_linear(dora.base_model.model[0]) is None  # a variant: peft merges it itself
    assert peft_compat.plain_lora_linear(torch.nn.Linear(4, 3)) is None


@pytest.mark.parametrize("alpha, exact", [(16, True), (12, False)], ids=["scaling-2", "scaling-1.5"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_scale_lora_down_keeps_peft_s_outputs_and_gradients(alpha, exact, autocast) -> None:
    """``B((A x) s)`` against peft's ``B(A x) s``: bitwise where ``s`` is a power of two (the same roundings, scaled),
    within one rounding of the product otherwise; peft's own forward for merged or disabled adapters and DoRA."""
    pytest.importorskip("peft")
    import copy

    from peft import LoraConfig, get_peft_model

    from lit_speed.compat import peft as peft_compat

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    theirs = get_peft_model(base, LoraConfig(r=8, lora_alpha=alpha, target_modules=["0", "2"],
                                             init_lora_weights=False))  # B != 0
    ours = copy.deepcopy(theirs)
    assert peft_compat.scale_lora_down(ours) == 2
    assert type(ours.base_model.model[0]).__name__ == "ScaledDownLoraLinear"
    assert peft_compat.plain_lora_linear(ours.base_model.model[0]) is not None  # still merged by hand
    x = torch.randn(5, 32)
    results = []
    for model in (theirs, ours):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
        trained = [p for p in model.parameters() if p.requires_grad]
        results.append((out, *torch.autograd.grad(out.float().square().sum(), trained)))
    for a, b in zip(*results):
        assert a.dtype == b.dtype
        if exact:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(b.float(), a.float(), rtol=2e-2 if autocast else 1e-5,
                                       atol=(2e-2 if autocast else 1e-5) * float(a.abs().max()))
    layer = ours.base_model.model[0]
    layer.merge()
    with torch.no_grad():  # merged: peft's forward (the base alone), not the adapter added a second time
        torch.testing.assert_close(ours(x), theirs(x).detach(), rtol=1e-5, atol=1e-5)
    dora = get_peft_model(torch.nn.Sequential(torch.nn.Linear(4, 3)),
                          LoraConfig(r=2, target_modules=["0"], use_dora=True))
    assert peft_compat.scale_lora_down(dora) == 0  # a variant keeps peft's class and forward
