"""Small public interfaces through which lit_speed's components talk to each other.

A component never imports another component's class to coordinate with it: it looks for an object that
implements one of these protocols (among ``trainer.callbacks``, or as ``trainer.strategy``). Any class with the
methods qualifies, so each side also works with a third-party counterpart, or alone.

* :class:`AccumulationDecider` - a callback that decides, per micro-batch, whether the optimizer steps after
  it (``lit_speed.AccumulationScheduler``). Read by ``lit_speed.ZeroStrategy`` to set DeepSpeed's boundary.
* :class:`AccumulationFollower` - a strategy that keeps its own accumulation state in step with that decision and
  scales a window's gradients on request (``lit_speed.ZeroStrategy``). ``AccumulationScheduler`` refuses other
  DeepSpeed strategies.
* :class:`PartwiseCheckpointWriter` - a strategy whose checkpoint every process writes a part of (DeepSpeed ZeRO
  folders) and that can write those parts without a collective (``lit_speed.ZeroStrategy``). Used by
  ``lit_speed.FaultTolerance``'s signal deadline, which saves from a watchdog thread while a step is running.
* :class:`OptimizerStateCost` - an optimizer that declares the bytes of state it keeps per parameter
  (``lit_speed.Lion``, ``lit_speed.MuonAdamW``, the low-bit AdamWs, ...). Asked by the memory planner and
  ``ZeroStrategy`` through ``lit_speed.state_bytes_per_param``, which also knows torch's and DeepSpeed's own optimizers.
* ``zero_refusal`` - an optimizer attribute, not a protocol: a class that cannot step DeepSpeed ZeRO's flat
  partitions sets it to the reason (``lit_speed.optim.low_bit``); ``ZeroStrategy`` refuses it at set-up with it.
* :class:`ChunkedLossModel` - a LightningModule that can compute its language-model loss in chunks of tokens
  (``lit_speed.GPTModule``, ``lit_speed.HFCausalLM``). Switched on by ``lit_speed.ChunkedLMLoss``, which wraps the
  Hugging Face causal LMs inside any other module instead.

Shared modules: a component package (``lit_speed/<component>/``) imports from another component package only
through the public names of ``lit_speed/__init__.py`` or one of these shared modules
(``tests/test_architecture.py`` checks it; keep ``SHARED_MODULES`` there in step with this list):

* ``lit_speed.interfaces`` - these protocols.
* ``lit_speed.run_contract`` - the protocols through which components report to the Hydra runner (start-up rows,
  end-of-run summaries, workload extras).
* ``lit_speed.compat`` (package) - every access to a private Lightning/DeepSpeed/torch name.
* ``lit_speed.tables`` - the start-up and end-of-run tables.
* ``lit_speed.step_logging`` - cheap per-step ``self.log`` of changing values.
* ``lit_speed.oom`` - recognising out-of-memory errors on any device.
* ``lit_speed.tensors`` - checks over whole tensors (``finite``) that make no temporary as large as the tensor.
* ``lit_speed.data.pipeline`` - the loader building blocks every DataModule uses (curriculum's included).
* ``lit_speed.tuning`` - choices timed on this machine and cached per machine (optimizer kernels, Muon's dtype, ...).
* ``lit_speed.precision.modes`` - the precision-mode table (``spec(mode)``: weight and compute dtypes, master copy,
  loss scaling, what DeepSpeed runs it as): every component asks it instead of spelling a mode.
* ``lit_speed.memory.model_state`` - the one calculator of model-state bytes (parameters, gradients, optimizer
  state) per mode, optimizer, ZeRO stage and world size.
* ``lit_speed.memory.host_memory`` - the one reading of the host memory a process can use (the smaller of its
  cgroup's limit and the machine's memory): the fit check, the planner, the verdict and the start-up table ask it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional, Protocol, runtime_checkable

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import torch


@runtime_checkable
class AccumulationDecider(Protocol):
    """A callback that decides whether the optimizer steps after the micro-batch now running."""

    def optimizer_steps_now(self) -> bool:
        """The decision for the current micro-batch, made in the callback's ``on_train_batch_start`` (which
        Lightning runs before the strategy's) and valid until the next one."""
        ...


@runtime_checkable
class AccumulationFollower(Protocol):
    """A strategy whose engine keeps its own accumulation state (e.g. DeepSpeed's ``gradient_accumulation_steps``
    and boundary), synchronised at every training batch from ``trainer.accumulate_grad_batches`` and the
    :class:`AccumulationDecider` among the callbacks."""

    def sync_accumulation(self, trainer: "pl.Trainer") -> None:
        """Bring the engine's accumulation state in line with the trainer's current decision."""
        ...

    def scale_step_gradients(self, scale: float) -> None:
        """Multiply the gradients the next optimizer step applies by ``scale`` (a window's normalisation, where the
        engine keeps gradients out of reach, e.g. ZeRO's flat partitions); ``1.0`` restores plain steps. Raises
        ``ValueError`` when the engine cannot (the decider calls it with ``1.0`` before training to find out)."""
        ...


def find_accumulation_decider(callbacks: Iterable[object]) -> Optional[AccumulationDecider]:
    """The first :class:`AccumulationDecider` among ``callbacks``, ``None`` if there is none."""
    return next((c for c in callbacks if isinstance(c, AccumulationDecider)), None)


@runtime_checkable
class PartwiseCheckpointWriter(Protocol):
    """A strategy whose checkpoint is a folder every process writes a part of, writable part by part without a
    collective (so from a thread, while the main thread is inside a training step)."""

    def module_state_for_checkpoint(self) -> dict:
        """The module state the checkpoint's model-states file holds (live tensors, not copies)."""
        ...

    def write_optimizer_part(self, folder: str) -> None:
        """Write this process's optimizer shard of the checkpoint ``folder``."""
        ...

    def write_model_states(self, folder: str, module_state: dict, client_state: dict) -> bool:
        """Write the model-states file of ``folder`` with ``module_state`` and the trainer's ``client_state``, on the
        process that writes it; returns whether this process wrote it. ``folder`` then needs only ``latest``."""
        ...


@runtime_checkable
class OptimizerStateCost(Protocol):
    """An optimizer that declares how much state it keeps, where it is defined."""

    def state_bytes_per_param(self, dtype: "torch.dtype | None" = None) -> float:
        """Bytes of state per trainable parameter, averaged over the optimizer's groups by element count, when the
        parameters are held in ``dtype`` (``None``: the dtypes they have now). A whole-tensor state costs
        ``dtype.itemsize`` per element (AdamW in float32: 8.0, Lion 4.0); a quantised one its codes, block scales and
        lookup tables (an 8-bit AdamW: ~2.03). ``step`` counters and other scalars are not counted."""
        ...


@runtime_checkable
class ChunkedLossModel(Protocol):
    """A module whose language-model loss can run the LM head and cross-entropy in chunks of tokens."""

    def use_chunked_loss(self, chunk_bytes: int | None) -> None:
        """Compute the loss in chunks whose logits take at most ``chunk_bytes`` (``None``: the plain loss again)."""
        ...
