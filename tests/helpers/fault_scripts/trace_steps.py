"""A step-by-step trace of a training run, to tell where a resumed run first parts from its uninterrupted twin.

A resumed run whose final checkpoint differs from the uninterrupted run's says *that* they differ, not *why*: a resume
that restored something wrongly (the batch, the dropout RNG, a weight, the optimizer or loss-scale state) and a
machine that computed the same step differently end alike. :class:`TraceSteps` writes, for every training batch, a
digest of everything that batch's computation reads (:data:`INPUTS`: the batch, the RNG states, the model's
parameters and buffers, the gradients just before the backward adds to them, the optimizer state and
hyperparameters, the precision plugin's state, the thread count and module modes), the loss it computed and the
digests of what it leaves (:data:`OUTPUTS`). :func:`first_divergence` walks the stopped run's batches, then the
resumed run's, beside the twin's: the first batch of the resumed run whose inputs differ is a resume bug (named by
what differs); a first batch whose inputs are bit for bit the twin's and whose loss or result is not is the machine
computing the same step twice differently, which no resume can prevent. :func:`judge_differing_resume` turns that
into a failure or a skip for a test.

Added to a run through Hydra (:func:`traced`): ``+callbacks.trace._target_=tests.helpers.fault_scripts.trace_steps.
TraceSteps +callbacks.trace.path=<file>`` (one JSON line per batch, appended: a stopped run and its resume share it).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

#: what a batch's computation reads, in the order :func:`first_divergence` names them
INPUTS = ("batch", "torch_rng", "python_rng", "numpy_rng", "weights", "grads", "optimizer", "precision", "threads",
          "modes")


def digest(obj: Any) -> str:
    """A short hash of the tensors, numbers and strings inside ``obj`` (dicts by sorted key, lists in order). Entries
    whose key names a reason are left out: a resumed run's read "restored from the checkpoint" where its twin's read
    "timed"."""
    h = hashlib.blake2b(digest_size=8)

    def feed(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            h.update(f"{type(x).__name__}{x.dtype}{tuple(x.shape)}".encode())
            h.update(_tensor_bytes(x))
        elif isinstance(x, np.ndarray):
            h.update(np.ascontiguousarray(x).tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                if "reason" not in str(k):
                    h.update(str(k).encode())
                    feed(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                feed(v)
        elif isinstance(x, (bool, int, float, str)) or x is None:
            h.update(repr(x).encode())

    feed(obj)
    return h.hexdigest()


#: what a batch leaves behind: weights, optimizer state (a step taken or not) and the precision state (the guard's
#: counters: a step skipped for an inf/NaN gradient)
OUTPUTS = ("weights", "optimizer", "precision")


def _optimizer_states(trainer: "pl.Trainer") -> list[dict[str, Any]]:
    states = [o.state_dict() for o in trainer.optimizers]
    for state in states:
        for group in state.get("param_groups", []):
            group.pop("params", None)  # parameter ids: numbering, not state
    return states


def _outputs(trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> dict[str, str]:
    return {"weights": digest(pl_module.state_dict()), "optimizer": digest(_optimizer_states(trainer)),
            "precision": digest(trainer.precision_plugin.state_dict())}


def _tensor_bytes(x: torch.Tensor) -> bytes:
    """A tensor's bytes; a subclass whose storage is not plain (torchao's quantized optimizer states) pickled."""
    if type(x) is torch.Tensor or type(x) is torch.nn.Parameter:
        t = x.detach().cpu().contiguous().reshape(-1)
        return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    import io

    buffer = io.BytesIO()
    torch.save(x.detach().cpu(), buffer)
    return buffer.getvalue()


class TraceSteps(Callback):
    """Appends one JSON line per training batch to ``path``: ``pid``, ``epoch``, ``batch_idx``, ``step``, the
    digests of :data:`INPUTS` (``"in"``), the losses' bits and values (``"loss"``, ``"loss_value"``: one per backward)
    and the digests of :data:`OUTPUTS` after the batch (``"out"``)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._record: dict[str, Any] = {}

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        inputs = {
            "batch": batch,
            "torch_rng": torch.get_rng_state(),
            "python_rng": list(random.getstate()[1]),
            "numpy_rng": np.random.get_state()[1],
            "weights": pl_module.state_dict(),
            "optimizer": _optimizer_states(trainer),
            "precision": trainer.precision_plugin.state_dict(),
            "threads": torch.get_num_threads(),
            "modes": [m.training for m in pl_module.modules()],
        }
        self._record = {"pid": os.getpid(), "epoch": trainer.current_epoch, "batch_idx": batch_idx,
                        "step": trainer.global_step, "in": {**{k: digest(v) for k, v in inputs.items()}, "grads": None},
                        "loss": [], "loss_value": []}

    @override
    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: torch.Tensor) -> None:
        # the gradients the backward adds to: read here, after the closure's zero_grad at a window's start (at the
        # batch's start they are the last step's, which nothing reads)
        self._record["in"]["grads"] = digest({n: p.grad for n, p in pl_module.named_parameters() if p.grad is not None})
        self._record["loss"].append(digest(loss))
        self._record["loss_value"].append(float(loss.detach().float()))

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._record["out"] = _outputs(trainer, pl_module)
        with open(self.path, "a") as f:
            f.write(json.dumps(self._record) + "\n")


def read_trace(path: str | Path) -> list[list[dict[str, Any]]]:
    """The records of a trace file, one list per process in the order they wrote (a stopped run, then its resume,
    where both wrote to the same file)."""
    processes: list[list[dict[str, Any]]] = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if not processes or processes[-1][-1]["pid"] != record["pid"]:
                processes.append([])
            processes[-1].append(record)
    return processes


def first_divergence(stopped: list[dict[str, Any]], resumed: list[dict[str, Any]], twin: list[dict[str, Any]]
                     ) -> tuple[str, str] | None:
    """Where a stopped-then-resumed run first parts from its uninterrupted twin, batch by batch at the same epoch
    and batch index (the stopped run's batches first, then the resumed run's):

    - ``("resume", what)``: a batch of the resumed run whose inputs differ (:data:`INPUTS`, named) while every batch
      before it matched: the resume restored something else;
    - ``("machine", what)``: a batch whose inputs are bit for bit the twin's and whose loss or resulting weights are
      not (the same computation gave another result), or a batch of the stopped run, before any resume, whose inputs
      differ (the run does not repeat itself);
    - ``None``: every batch both processes trained equals the twin's.

    Raises:
        AssertionError: The resumed run trained no batch, or one its twin never trained.
    """
    if not resumed:
        raise AssertionError("the resumed run traced no training batch")
    by_position = {(r["epoch"], r["batch_idx"]): r for r in twin}
    for run, records in (("the stopped run", stopped), ("the resumed run", resumed)):
        for record in records:
            where = f"{run}'s epoch {record['epoch']} batch {record['batch_idx']} (step {record['step']})"
            other = by_position.get((record["epoch"], record["batch_idx"]))
            if other is None:
                raise AssertionError(f"{run} trained epoch {record['epoch']} batch {record['batch_idx']}, which its "
                                     "uninterrupted twin never reached")
            differ = [k for k in INPUTS if record["in"][k] != other["in"][k]]
            if record["step"] != other["step"]:
                differ.insert(0, f"the step counter ({record['step']} vs {other['step']})")
            if differ:
                kind = "resume" if run == "the resumed run" else "machine"
                return kind, f"at {where} the inputs differ from the twin's: {', '.join(differ)}"
            if record["loss"] != other["loss"]:
                return "machine", (f"at {where} every input ({', '.join(INPUTS)}) is bit for bit the twin's and the "
                                   f"loss is not ({record['loss_value']} vs {other['loss_value']}): the same forward "
                                   "computed differently")
            after = [k for k in OUTPUTS if record["out"][k] != other["out"][k]]
            if after:
                return "machine", (f"at {where} every input and the loss are bit for bit the twin's and the "
                                   f"{', '.join(after)} after the batch are not: the same backward and optimizer step "
                                   "computed differently")
    return None


def trace_path(run_dir: Path) -> Path:
    """Where :func:`traced` has a run in ``run_dir`` write its trace: ``<run_dir>.trace.jsonl`` beside the folder."""
    return run_dir.with_name(run_dir.name + ".trace.jsonl")


def traced(args: list[str], run_dir: Path) -> list[str]:
    """``args`` with :class:`TraceSteps` writing :func:`trace_path` of ``run_dir``."""
    return [*args, "+callbacks.trace._target_=tests.helpers.fault_scripts.trace_steps.TraceSteps",
            f"+callbacks.trace.path={trace_path(run_dir)}"]


def judge_differing_resume(run_dir: Path, twin_dir: Path, difference: AssertionError) -> None:
    """A stopped-then-resumed run (both traced into ``run_dir``'s trace) whose checkpoint differs from its traced
    uninterrupted twin's, judged by :func:`first_divergence`: inputs that differ at the first differing batch raise
    (a resume bug, named, however small its effect); inputs equal bit for bit with another loss or result skip the
    test, naming the machine and the batch (the same computation gave two results here: no resume can be judged
    bitwise on it). Returns when the traces agree everywhere (the caller judges by other means). The verdict is
    also a warning: CI's log shows the warnings summary, not an expected failure's message."""
    import warnings

    import pytest

    from lit_speed.tuning.machine_cache import hardware

    processes = read_trace(trace_path(run_dir))
    assert len(processes) == 2, f"the stopped and the resumed run traced {len(processes)} processes, not 2"
    verdict = first_divergence(*processes, read_trace(trace_path(twin_dir))[0])
    if verdict is None:
        return
    kind, where = verdict
    warnings.warn(f"{run_dir.parent.name}: the first batch that differs says {kind}: {where}", stacklevel=2)
    if kind == "resume":
        raise AssertionError(f"{difference}; the resumed run restored something else: {where}") from difference
    pytest.skip(f"this machine ({hardware()}) does not repeat the run bit for bit: {where}; so the resumed run's "
                f"difference cannot be judged ({difference})")
