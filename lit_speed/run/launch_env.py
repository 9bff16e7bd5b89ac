"""What a launched process reads from its launcher: one run folder for every process of a ``torchrun`` launch (rank 0
picks the time stamp, the others are told), the launcher's ``--local_rank`` argument, a free main port. How the
process ends is :mod:`lit_speed.run.process_end`'s.

One run folder: Hydra resolves ``${now:...}`` in ``hydra.run.dir`` in each process on its own, so ranks started a
second apart write to different folders. Lightning's own launcher avoids this by passing ``hydra.run.dir=<rank 0's
folder>`` to the processes it starts; under ``torchrun`` no process starts the others, so rank 0 publishes its time stamp
through the store torchrun's agent already runs for the workers (``TORCHELASTIC_USE_AGENT_STORE``), and every
rank reads it into ``LIT_SPEED_RUN_TIME``, which ``conf/hydra/default.yaml`` uses instead of ``${now:...}``.
"""
from __future__ import annotations

import os
from datetime import datetime, timedelta

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
