"""Ports chosen free (issue 50, item 6): a run that starts its own processes and inherits a ``MASTER_PORT`` someone
already listens on (another run, or a process group an earlier fit in the parent process left open) takes a free
port instead of stopping in ``EADDRINUSE``; the tests pick free ports instead of fixed ones.

Before: the H200 selfcheck's ``zero_offload_gpu`` failed with ``EADDRINUSE`` (port 57159, inherited from in-process
fits), and the exit tests bound fixed ports 29541-29549 (two test sessions on one machine collided).
"""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from lit_speed.run.launch_env import free_port, move_busy_main_port, port_in_use
from tests.helpers.fault_scripts.runs import ROOT, env, explain


@pytest.fixture
def held_port():
    """A port another process would hold: a listening socket."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_busy_inherited_port_is_replaced_by_a_free_one(held_port):
    env = {"MASTER_PORT": str(held_port)}
    line = move_busy_main_port(env)
    assert line.startswith(f"MASTER_PORT={held_port} is in use on this machine")
    assert int(env["MASTER_PORT"]) != held_port and not port_in_use(int(env["MASTER_PORT"]))


@pytest.mark.parametrize("extra", [{"LOCAL_RANK": "1"}, {"RANK": "0"}, {"MASTER_ADDR": "10.1.2.3"},
                                   {"NODE_RANK": "1"}])
def test_a_port_the_launcher_or_other_nodes_were_told_is_left_alone(held_port, extra):
    env = {"MASTER_PORT": str(held_port), **extra}
    assert move_busy_main_port(env) is None and env["MASTER_PORT"] == str(held_port)


def test_a_free_or_unset_port_is_left_alone():
    port = str(free_port())
    env = {"MASTER_PORT": port}
    assert move_busy_main_port(env) is None and env == {"MASTER_PORT": port}
    assert move_busy_main_port({}) is None


@pytest.mark.slow  # two processes (Lightning's launcher), each importing torch + Lightning
def test_a_two_process_run_with_a_busy_inherited_port_trains(tmp_path, held_port):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "trainer=ddp_cpu", "strategy=ddp",
                           "trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1",
                           "logger=none", "validate=false", "trainer.enable_progress_bar=false",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT,
                          env={**env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(held_port)},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, explain(done)
    assert f"MASTER_PORT={held_port} is in use on this machine" in done.stderr, explain(done)
    assert (tmp_path / "run" / "summary.json").is_file()
