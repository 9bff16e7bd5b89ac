"""One run folder for every process of a ``torchrun`` launch: rank 0 picks the time stamp, the others are told.

Hydra resolves ``${now:...}`` in ``hydra.run.dir`` in each process on its own, so ranks started a second apart
write to different folders. Lightning's own launcher avoids this by passing ``hydra.run.dir=<rank 0's folder>``
to the processes it starts; under ``torchrun`` no process starts the others, so rank 0 publishes its time stamp
through the store torchrun's agent already runs for the workers (``TORCHELASTIC_USE_AGENT_STORE``), and every
rank reads it into ``LIT_SPEED_RUN_TIME``, which ``conf/hydra/default.yaml`` uses instead of ``${now:...}``.
"""
from __future__ import annotations

import contextlib
import os
from datetime import datetime, timedelta
from typing import Any, Callable

RUN_TIME_ENV = "LIT_SPEED_RUN_TIME"
RUN_TIME_FORMAT = "%Y-%m-%d_%H-%M-%S"  # the pattern of ${now:...} in conf/hydra/default.yaml


def share_run_time(timeout_s: float = 120.0) -> str | None:
    """Under ``torchrun`` with more than one process, set ``LIT_SPEED_RUN_TIME`` to rank 0's time stamp.

    Returns:
        The shared time stamp, or ``None`` when not launched by ``torchrun`` (or already set).
    """
    env = os.environ
    if RUN_TIME_ENV in env or "TORCHELASTIC_RUN_ID" not in env or int(env.get("WORLD_SIZE", "1")) < 2:
        return env.get(RUN_TIME_ENV)
    if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None  # no store to share through before the process group exists: Hydra's own ${now:...}
    from torch.distributed import TCPStore

    store = TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                     timeout=timedelta(seconds=timeout_s))
    key = f"lit_speed/run_time/{env['TORCHELASTIC_RUN_ID']}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if int(env["RANK"]) == 0:
        store.set(key, datetime.now().strftime(RUN_TIME_FORMAT))
    stamp = store.get(key).decode()  # blocks until rank 0 has set it
    env[RUN_TIME_ENV] = stamp
    return stamp


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

    Why: a finished 2-process ZeRO-3 run ended with "terminate called without an active exception" (exit -6) in 2
    of 30 runs on 2026-11-28, also after :func:`release_process_group`: a core dump showed gloo's worker thread
    (``ProcessGroupGloo::runLoop``) destroying an ``AsyncAllgatherWork`` whose tensors hold Python objects and taking
    the GIL while the interpreter finalizes (pytorch/pytorch#190489; the atexit fix of #179291 was abandoned
    upstream). Every atexit hook the run's code registered (loggers, a W&B run's finish, ``logging``'s shutdown)
    has run by then; what is skipped is the teardown of modules and objects, which is where the abort happens. Only
    hooks registered before ``scripts/train.py`` started (by ``.pth`` files, e.g. ``coverage``'s subprocess start-up)
    would run after this one and are skipped too: ``LIT_SPEED_EXIT=interpreter`` keeps the interpreter's exit.
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


LOCAL_RANK_FLAGS = ("--local_rank", "--local-rank")  # the deepspeed launcher's and torch.distributed.launch's


def drop_local_rank_argument(argv: list[str]) -> list[str]:
    """``argv`` without the ``--local_rank=N`` (or ``--local_rank N``) a launcher appends for its workers.

    The ``deepspeed`` launcher (unless ``--no_local_rank``) and the old ``torch.distributed.launch`` pass it on
    the command line, where Hydra refuses it; the rank is also in ``LOCAL_RANK``, which is set from it if missing.
    """
    out: list[str] = []
    args = iter(argv)
    for arg in args:
        flag, _, value = arg.partition("=")
        if flag in LOCAL_RANK_FLAGS:
            value = value or next(args, "")
            os.environ.setdefault("LOCAL_RANK", value)
            continue
        out.append(arg)
    return out


# ---------------------------------------------------------------------------------------------- the main port
LOOPBACK = ("127.0.0.1", "localhost", "::1", "0.0.0.0", "")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (the kernel's choice for port 0): what a test or a run on one machine uses
    instead of a fixed number, so that two of them at once do not collide."""
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a listener holds ``port`` on ``host`` (a bind as ``torch.distributed``'s store does it fails)."""
    import socket

    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def move_busy_main_port(env: dict[str, str] | None = None) -> str | None:
    """On one machine, a ``MASTER_PORT`` inherited by a run that starts its own processes (Lightning's launcher; not a
    process ``torchrun``, the ``deepspeed`` launcher or Lightning started, which have ``LOCAL_RANK``) and already in
    use (another run's, or a group an earlier fit in the parent left alive): replaced by a free port, so the run does
    not stop in ``EADDRINUSE``. Returns the line to print, or ``None`` when nothing changed. A ``MASTER_ADDR`` of
    another machine, or a node rank > 0, is left alone: the other nodes were told that port."""
    env = os.environ if env is None else env
    if "MASTER_PORT" not in env or "LOCAL_RANK" in env or "RANK" in env:
        return None
    host = env.get("MASTER_ADDR", "127.0.0.1")
    if host not in LOOPBACK or env.get("NODE_RANK", "0") != "0":
        return None
    try:
        port = int(env["MASTER_PORT"])
    except ValueError:
        return None
    if not port_in_use(port, host or "127.0.0.1"):
        return None
    env["MASTER_PORT"] = str(free_port(host or "127.0.0.1"))
    return (f"MASTER_PORT={port} is in use on this machine (another run, or a process group left open): this run "
            f"uses the free port {env['MASTER_PORT']} instead (unset MASTER_PORT to have one chosen every time)")
