"""How a ``scripts/train.py`` process ends: its process group released, its exit status kept, and, after a run that
had a process group, the end through ``os._exit`` once every ``atexit`` hook has run (:func:`exit_after_exit_hooks`),
without the interpreter's finalization, where gloo's worker threads can abort the process (pytorch/pytorch#190489).
Scripts of your own end the same way with :func:`end_distributed_process`.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable


def release_process_group() -> None:
    """Destroy the default process group, if this process has one, before the interpreter exits.

    Lightning keeps the group after ``fit`` (a ``test`` may follow). Every rank calls this once its work is done, so
    no collective is cut short. A process that had a group then ends through :func:`exit_after_exit_hooks` (when
    ``scripts/train.py`` registered it): destroying the group does not stop every abort at exit.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        _ENDING["had_group"] = True


def release_process_group_at_exit() -> None:
    """Have this process release its process group in an ``atexit`` hook (once), then collect garbage, while the
    interpreter is still whole: for a DDP run in a process lit_speed does not end itself (a ``ddp_spawn`` worker,
    another script), so that the group's gloo worker threads are joined before the interpreter finalizes.

    Once Lightning has unwrapped DDP at teardown, nothing else holds the group: destroying it (plus the collection
    of DDP's reference cycles) runs its destructor, which joins the worker threads, so none is left to take the GIL
    in the finalization (the abort of pytorch/pytorch#190489; a Python comm hook's future is such work). DeepSpeed's
    engine, optimizer and parameters keep their group alive: a ZeRO run ends through
    :func:`end_distributed_process` instead.
    """
    if _ENDING["release_registered"]:
        return
    import atexit
    import gc

    def _release() -> None:
        release_process_group()
        gc.collect()

    atexit.register(_release)
    _ENDING["release_registered"] = True


#: How this process ends: whether a process group existed and the exit status (what :func:`exit_after_exit_hooks`
#: needs), and whether :func:`release_process_group_at_exit` has registered its hook.
_ENDING: dict[str, Any] = {"had_group": False, "status": None, "release_registered": False}
#: Set to ``interpreter`` to end every run through the interpreter's own finalization (see exit_after_exit_hooks).
EXIT_ENV = "LIT_SPEED_EXIT"


def exit_after_exit_hooks() -> None:
    """The ``atexit`` hook ``scripts/train.py`` registers before anything else, so it runs after every other one:
    a process that had a process group ends with ``os._exit(<its status>)`` there, skipping only the interpreter's
    finalization; a run without one exits as Python does.

    Why: after a run with a process group, gloo's worker thread (``ProcessGroupGloo::runLoop``) can still be
    destroying a collective's work whose tensors hold Python objects, and take the GIL while the interpreter
    finalizes: the process aborts ("terminate called without an active exception", exit -6), also after
    :func:`release_process_group` (pytorch/pytorch#190489). Every atexit hook the run's code registered (loggers, a
    W&B run's finish, ``logging``'s shutdown) has run by then; what is skipped is the teardown of modules and
    objects, which is where the abort happens. Only hooks registered before ``scripts/train.py`` started (by
    ``.pth`` files, e.g. ``coverage``'s subprocess start-up) would run after this one and are skipped too:
    ``LIT_SPEED_EXIT=interpreter`` keeps the interpreter's exit.
    The status is the one Python would give (:func:`record_exit_status`); an interrupted run (Ctrl-C) still ends
    by SIGINT.
    """
    status = _ENDING["status"]
    if not _ENDING["had_group"] or status is None or os.environ.get(EXIT_ENV) == "interpreter":
        return
    import logging
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if status == "sigint":
        import signal

        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status if isinstance(status, int) else 1)


def run_and_release(main: Callable[[], Any]) -> None:
    """``main()``, its exit status recorded for :func:`exit_after_exit_hooks` (:func:`record_exit_status`), then the
    process group released, whatever happened: how ``scripts/train.py`` runs its Hydra main."""
    try:
        main()
    except BaseException as error:  # SystemExit included: Hydra's and ours (exit codes 1, 2, 143, ...)
        record_exit_status(error)
        raise
    else:
        record_exit_status(None)
    finally:
        release_process_group()  # before the interpreter's exit, where gloo's threads can abort it


def end_distributed_process() -> None:
    """The last call of a script of your own that ran a fit with a process group (DDP, ``ZeroStrategy``, ``torchrun``;
    gloo on CPU): wait for every rank, release the group, run every ``atexit`` hook as Python would, then end with
    status 0 without the interpreter's finalization, as ``scripts/train.py`` does (:func:`exit_after_exit_hooks`).

    Why: a finished run's gloo worker thread can still be destroying a collective's work (tensors that hold Python
    objects) when the interpreter finalizes, and the process aborts there ("terminate called without an active
    exception", exit -6 / 134; pytorch/pytorch#190489). Destroying the group does not stop it under DeepSpeed: its
    engine, optimizer and every parameter keep the group's worker threads alive. Without a process group, or with
    ``LIT_SPEED_EXIT=interpreter``, it only releases the group and returns, and Python exits as usual.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()  # no rank leaves while another still writes its results
    release_process_group()
    record_exit_status(None)
    if os.environ.get(EXIT_ENV) == "interpreter":
        return
    from lit_speed.compat.python import run_exit_hooks

    run_exit_hooks()  # loggers' and the user's hooks, last registered first, as at a normal exit
    exit_after_exit_hooks()


def record_exit_status(error: BaseException | None) -> None:
    """The status the process will exit with, as Python gives it: 0 without ``error``, a ``SystemExit``'s code (None:
    0, an int: itself, anything else: 1, printed by Python), ``"sigint"`` for KeyboardInterrupt, else 1."""
    if error is None:
        status: Any = 0
    elif isinstance(error, SystemExit):
        code = error.code
        status = 0 if code is None else int(code) if isinstance(code, int) else 1
    elif isinstance(error, KeyboardInterrupt):
        status = "sigint"
    else:
        status = 1
    _ENDING["status"] = status
