"""How ``scripts/train.py`` ends (``process_end.exit_after_exit_hooks``): a process that had a process group runs every
atexit hook the run registered, then ends with Python's own status without the interpreter's finalization (where
gloo's threads aborted finished 2-process runs, exit -6); a run without a group, or with ``LIT_SPEED_EXIT=
interpreter``, ends as Python ends. Each case in a process of its own, set up as train.py sets itself up."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from lit_speed.run.launch_env import free_port
from tests.helpers.repo import ROOT

SCRIPT = """
import atexit, os, sys
from lit_speed.run import process_end
atexit.register(process_end.exit_after_exit_hooks)  # first, as in scripts/train.py

class Sentinel:
    # runs only in the interpreter's finalization (module teardown); os.write bound now: by then `os` may already be
    # None in __main__ (its names are cleared in order once something, e.g. dill, which torch imports when it is
    # installed, holds __main__ alive)
    def __del__(self, write=os.write):
        write(1, b"finalized\\n")

SENTINEL = Sentinel()
atexit.register(lambda: os.write(1, b"user hook\\n"))  # a run's own hook (a logger's finish), registered later
import torch.distributed as dist
if {group}:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}")
    dist.init_process_group("gloo", rank=0, world_size=1)
    dist.all_reduce(__import__("torch").ones(3))

def main():
    {body}

process_end.run_and_release(main)  # as scripts/train.py runs its Hydra main
"""


def _python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``code`` in a Python process of its own, from the repository root."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def _run(body: str, group: bool, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return _python(SCRIPT.format(group=group, port=free_port(), body=body), env)


@pytest.mark.parametrize("body,status,printed", [
    ("print('done')", 0, "done"),
    ("sys.exit(143)", 143, ""),  # a stop signal's exit (RunStopped)
    ("sys.exit('Config error: x')", 1, "Config error: x"),  # Python prints a non-int code to stderr
    ("raise RuntimeError('broken')", 1, "RuntimeError: broken"),  # the traceback is printed before the hooks
])
def test_a_run_with_a_process_group_runs_its_hooks_and_ends_with_its_status_without_finalization(body, status,
                                                                                                printed):
    done = _run(body, group=True)
    assert done.returncode == status, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1:] == ["user hook"]  # the run's hook ran, last; no finalization after it
    assert "finalized" not in done.stdout
    assert printed in done.stdout + done.stderr


def test_an_interrupted_run_with_a_process_group_still_ends_by_sigint():
    done = _run("raise KeyboardInterrupt", group=True)
    assert done.returncode == -signal.SIGINT and "user hook" in done.stdout and "finalized" not in done.stdout


@pytest.mark.parametrize("group,env", [(False, None), (True, {"LIT_SPEED_EXIT": "interpreter"})])
def test_without_a_group_or_when_asked_the_interpreter_ends_the_run(group, env):
    done = _run("sys.exit(3)", group=group, env=env)
    assert done.returncode == 3, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["user hook", "finalized"]


OWN_SCRIPT = """
import atexit, os
from lit_speed.run.process_end import end_distributed_process
atexit.register(lambda: os.write(1, b"imported hook\\n"))  # registered at import, before the run (logging's is)

class Sentinel:
    def __del__(self, write=os.write):  # bound now: see SCRIPT
        write(1, b"finalized\\n")

SENTINEL = Sentinel()
import torch, torch.distributed as dist
if {group}:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}")
    dist.init_process_group("gloo", rank=0, world_size=1)
    dist.all_reduce(torch.ones(3))
atexit.register(lambda: os.write(1, b"user hook\\n"))  # the script's own, registered during the run
print("work done", flush=True)
end_distributed_process()
print("after the call")
"""


@pytest.mark.parametrize("group,env,lines", [
    (True, None, ["work done", "user hook", "imported hook"]),  # every hook, Python's order; no finalization
    (True, {"LIT_SPEED_EXIT": "interpreter"}, ["work done", "after the call", "user hook", "imported hook",
                                               "finalized"]),
    (False, None, ["work done", "after the call", "user hook", "imported hook", "finalized"]),
])
def test_a_script_of_ones_own_ends_through_end_distributed_process(group, env, lines):
    """The call a script outside scripts/train.py makes last: with a group, every atexit hook runs (last registered
    first) and the process ends 0 without finalization; without one, or when asked, Python's usual exit."""
    done = _python(OWN_SCRIPT.format(group=group, port=free_port()), env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == lines


SPAWNED_WORKER = """
import atexit, os, torch, torch.distributed as dist
from lit_speed.run.process_end import release_process_group_at_exit

def gloo_threads():
    names = [open(f"/proc/self/task/{{t}}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return sorted(n for n in names if "gloo" in n)

atexit.register(lambda: print("at finalization:", gloo_threads()))  # registered first: runs after the others
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}")
dist.init_process_group("gloo", rank=0, world_size=1)
# a Python callback on the future, as DDP's comm hooks have; the Work itself not kept (DDP keeps none either)
dist.all_reduce(torch.ones(3), async_op=True).get_future().then(lambda fut: fut.value()).wait()
print("running:", len(gloo_threads()) > 0)
if {release}:
    release_process_group_at_exit()
    release_process_group_at_exit()  # once is enough; twice registers one hook
"""


@pytest.mark.parametrize("release", [True, False])
def test_release_at_exit_leaves_no_gloo_thread_to_the_finalization(release):
    """A process lit_speed does not end itself (a ddp_spawn worker): the atexit hook destroys the group while the
    interpreter is whole, and its worker threads are joined before the finalization; without it they are left."""
    done = _python(SPAWNED_WORKER.format(port=free_port(), release=release))
    # without the hook the threads left to the finalization may abort it (-6, "terminate called without an active
    # exception": the hazard the hook removes, pytorch#190489): once in three default-tier runs on Z4, 2026-12-03
    assert done.returncode == 0 or (not release and done.returncode == -6
                                    and "terminate called" in done.stderr), done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "running: True"
    if release:
        assert lines[1:] == ["at finalization: []"]
    else:
        assert lines[1].startswith("at finalization: [") and "gloo" in lines[1]
