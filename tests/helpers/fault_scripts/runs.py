"""Run ``scripts/train.py`` in a fresh interpreter for the fault tests, with this checkout importable."""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent

# a short, deterministic digits run: 3 epochs of 8 batches, a checkpoint (last.ckpt) at every epoch end
SHORT_RUN = ["trainer.max_epochs=3", "trainer.limit_train_batches=8", "trainer.limit_val_batches=2",
             "trainer.num_sanity_val_steps=0", "trainer.deterministic=true", "seed=7",
             "callbacks=[model_checkpoint,fault_tolerance]", "logger=none", "validate=false",
             "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]
STEPS_PER_EPOCH = 8


def env() -> dict[str, str]:
    """The environment of a child run: the checkout's root first on PYTHONPATH, so ``lit_speed`` and
    ``_target_: tests.helpers.fault_scripts.kill_at_step.KillAtStep`` import from this checkout."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**os.environ, "PYTHONPATH": path, "HYDRA_FULL_ERROR": "0", "DS_ACCELERATOR": "cpu"}


def train(args: list[str], run_dir: Path, timeout: float = 600, script: str | None = None
          ) -> subprocess.CompletedProcess:
    """``python scripts/train.py <args> hydra.run.dir=<run_dir>``; returns the finished process (text output)."""
    command = [sys.executable, script or str(ROOT / "scripts" / "train.py"), *args, f"hydra.run.dir={run_dir}"]
    return subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)


def train_side_by_side(*jobs: tuple[list[str], Path], timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """:func:`train` for each ``(args, run_dir)`` at the same time (a resumed run beside its uninterrupted twin, as a
    busy machine runs them); the finished processes in the jobs' order."""
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: train(*job, timeout=timeout), jobs))


def kill_at(step: int = -1, rank: int = 0, mode: str = "step", batch: int | None = None) -> list[str]:
    """Overrides that add :class:`kill_at_step.KillAtStep` to a run (at an optimizer ``step``, or after ``batch``
    training batches)."""
    return ["+callbacks.kill._target_=tests.helpers.fault_scripts.kill_at_step.KillAtStep",
            f"+callbacks.kill.step={step}", f"+callbacks.kill.rank={rank}", f"+callbacks.kill.mode={mode}"] + (
        [f"+callbacks.kill.batch={batch}"] if batch is not None else [])


def explain(proc: subprocess.CompletedProcess) -> str:
    """The tail of a child's output, for assertion messages."""
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"


def signal_after(args: list[str], run_dir: Path, marker: str, delay_s: float, signum: int,
                 timeout: float = 600) -> subprocess.CompletedProcess:
    """Start ``scripts/train.py``, send ``signum`` to its main process ``delay_s`` after ``marker`` appears in its
    output, and wait for it (``timeout`` bounds a hang). Returns the finished process (text output)."""
    import time

    log = run_dir.with_name(run_dir.name + ".log")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(ROOT / "scripts" / "train.py"), *args, f"hydra.run.dir={run_dir}"]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env(), stdout=out, stderr=subprocess.STDOUT, text=True)
        start = time.monotonic()
        while proc.poll() is None and marker not in log.read_text() and time.monotonic() - start < timeout:
            time.sleep(0.1)
        time.sleep(delay_s)
        if proc.poll() is None:
            proc.send_signal(signum)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            subprocess.run(["pkill", "-9", "-f", f"hydra.run.dir={run_dir}"], check=False)  # every rank of this run
            proc.wait()
    return subprocess.CompletedProcess(command, proc.returncode, log.read_text(), "")
