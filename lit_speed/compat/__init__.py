"""The one door to private Lightning, DeepSpeed, torch and Hydra names: every access lit_speed makes to one is here.

Nothing else in ``lit_speed`` reads, writes, imports or overrides a private name of these libraries
(``tests/test_architecture.py`` scans for it); ``tests/compat/test_compat.py`` pins every name used here and fails
naming the one that moved. After upgrading a library, run that file, then re-read the helpers it names.

Modules, by library (each function states the version it was written against):

* :mod:`lit_speed.compat.lightning` - loop, trainer and module internals of Lightning: the accumulation
  decisions (instance patches of the fit loop), the logger cadence, the SIGTERM flag, a precision plugin's
  closure hook, a module's trainer link, a strategy's precision-plugin property and DDP's environment setup.
* :mod:`lit_speed.compat.lightning_data` - the fit loop's data fetcher and data source.
* :mod:`lit_speed.compat.lightning_loops` - the fit loop's restart at an epoch's end, the SIGTERM handler and
  per-batch broadcast that stop signals replace, the log rows written after checkpoint hooks, and
  ``dump_checkpoint`` (instance patches of one Trainer's loop objects, installed once).
* :mod:`lit_speed.compat.torchmetrics` - a metric's update count and cached result, to restore its state.
* :mod:`lit_speed.compat.datasets` - ``datasets``' offline switch, set for one ``load_dataset`` call when the Hub
  cannot be reached (:func:`lit_speed.compat.datasets.hub_offline`).
* :mod:`lit_speed.compat.deepspeed` - DeepSpeed itself and Lightning's ``DeepSpeedStrategy`` internals.
* :mod:`lit_speed.compat.hydra` - Hydra's command-line parser and ``@hydra.main``'s config search path (hydra-core
  1.3.8), so the pre-flight composes from the folders Hydra will search.
* :mod:`lit_speed.compat.peft` - a LoRA ``Linear``'s adapter internals (``lora_variant``, ``lora_bias``, ``scaling``,
  ``fan_in_fan_out``), for the merged export's hand merge (peft 0.21.2).
* :mod:`lit_speed.compat.python` - CPython's ``atexit._run_exitfuncs``, to run the exit hooks before an exit
  without the interpreter's finalization (:func:`lit_speed.run.process_end.end_distributed_process`).
* :mod:`lit_speed.compat.torch` - private torch ops and modules (``_foreach_*``, pytree, dispatch modes,
  ``torch.compile``'s module wrapper, the oneDNN bf16 check).

Process-wide patches: none stays after the call that needs it. ``deepspeed.initialize``, DeepSpeed's
``build_shm_op`` and its two memory readers are replaced only inside ``with`` blocks
(:func:`lit_speed.compat.deepspeed.intercept_deepspeed_initialize`,
:func:`lit_speed.compat.deepspeed.shm_comm_build_skipped`,
:func:`lit_speed.compat.deepspeed.memory_readers_follow_accelerator`, held by ``ZeroStrategy`` from set-up to
teardown); ``tests/test_architecture.py`` refuses an assignment into another library's module anywhere else, or
here outside a ``@contextmanager`` that restores it in ``finally``. The loop patches are per ``Trainer`` instance and
removed at teardown (:func:`lit_speed.compat.lightning.uninstall_accumulation_controller`); ``muted_log`` and
``detached_from_trainer`` patch one module for the length of a ``with`` block.

The submodules are not imported here, so ``import lit_speed.compat`` stays cheap (no DeepSpeed).
"""
from __future__ import annotations

LIGHTNING_VERSION = "2.6.6"  # the versions these helpers were written and tested against
DEEPSPEED_VERSION = "0.19.8"
TORCH_VERSION = "2.13"
