"""Two nodes on one machine: the README's command run by two torchrun agents at once (c10d rendezvous on 127.0.0.1,
gloo), with ``strategy=ddp`` and ``strategy=zero2``. Slow tier.

Each run must leave what a user looks at: one run folder with one ``summary.json`` that says 1 device x 2 nodes,
and a ``ckpt_path=last`` resume at an epoch end that ends on the uninterrupted run's validation metrics.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from lit_speed.run.launch_env import RUN_TIME_ENV, free_port
from tests.helpers.repo import ROOT

README = (ROOT / "README.md").read_text()
TINY = ["trainer.limit_train_batches=4", "trainer.limit_val_batches=2", "logger=none",
        "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


def readme_two_node_command() -> list[str]:
    """The README's "two nodes on this machine" torchrun command (the line after its comment), as argv."""
    block = re.search(r"# two nodes on this machine.*?\n(torchrun .*?)\n(?!\s)", README.replace("\\\n", " "), re.S)
    assert block, "the README's 'More than one machine' section lost its two-nodes-on-this-machine command"
    return shlex.split(block.group(1))


def launch_two_nodes(overrides: list[str], run_id: str, timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """Start the README's command twice, as two torchrun agents (one per "node"), and wait for both."""
    argv = readme_two_node_command()
    port = free_port()
    argv = [re.sub(r"127\.0\.0\.1:\d+", f"127.0.0.1:{port}", a) for a in argv]
    argv = [f"--rdzv-id={run_id}" if a.startswith("--rdzv-id") else a for a in argv]
    argv = [str(ROOT / a) if a == "scripts/train.py" else a for a in argv]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "HYDRA_FULL_ERROR": "0", "PYTHONPATH": str(ROOT)}
    env.pop(RUN_TIME_ENV, None)
    agents = [subprocess.Popen([*argv, *overrides], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True) for _ in range(2)]
    done = []
    for agent in agents:
        try:
            out, err = agent.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in agents:
                other.kill()
            raise
        done.append(subprocess.CompletedProcess(agent.args, agent.returncode, out, err))
    return done


def _only_run(log_dir: Path) -> Path:
    runs = sorted((log_dir / "train" / "runs").iterdir())
    assert len(runs) == 1, f"the two nodes disagreed on the run folder: {runs}"
    assert sorted(p.relative_to(log_dir) for p in log_dir.rglob("summary.json")) == \
        [runs[0].relative_to(log_dir) / "summary.json"]
    return runs[0]


def _ok(agents: list[subprocess.CompletedProcess]) -> None:
    for agent in agents:
        assert agent.returncode == 0, agent.stderr[-3000:]


def test_the_readme_shows_the_two_node_command():
    argv = readme_two_node_command()
    assert argv[:6] == ["torchrun", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                        "--rdzv-endpoint=127.0.0.1:29500", "--rdzv-id=local"]
    assert "scripts/train.py" in argv and "trainer.num_nodes=2" in argv


@pytest.mark.slow  # three two-node launches per strategy (ZeRO: DeepSpeed start-up in each)
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_two_nodes_write_one_run_folder_and_resume_to_the_uninterrupted_result(tmp_path, strategy):
    common = [f"strategy={strategy}", *TINY]
    _ok(launch_two_nodes([*common, "trainer.max_epochs=3", f"paths.log_dir={tmp_path / 'whole'}"], f"{strategy}-w"))
    whole = json.loads((_only_run(tmp_path / "whole") / "summary.json").read_text())

    _ok(launch_two_nodes([*common, "trainer.max_epochs=2", f"paths.log_dir={tmp_path / 'cut'}"], f"{strategy}-c"))
    run = _only_run(tmp_path / "cut")
    first = json.loads((run / "summary.json").read_text())
    assert first["startup"]["strategy"].endswith("(1 device(s) x 2 node(s))")
    assert first["startup"]["effective batch"] == "64 micro x 1 accumulation x 2 process(es) = 128"
    assert first["global_step"] == 8 and first["status"] == "finished"
    last = run / "checkpoints" / "last.ckpt"
    if strategy == "zero2":  # DeepSpeed's folder: each node's rank wrote its optimizer shard into it
        assert len(list(last.rglob("*optim_states.pt"))) == 2
    else:
        assert last.is_file()

    agents = launch_two_nodes([*common, "trainer.max_epochs=3", f"paths.log_dir={tmp_path / 'cut'}", "ckpt_path=last",
                               f"hydra.run.dir={run}"], f"{strategy}-r")
    _ok(agents)
    assert _only_run(tmp_path / "cut") == run
    assert any("Restored all states from the checkpoint" in a.stdout + a.stderr for a in agents)
    resumed = json.loads((run / "summary.json").read_text())
    assert resumed["global_step"] == whole["global_step"] == 12
    assert resumed["final_val"] == whole["final_val"]  # the resumed run ends where the uninterrupted one ends
