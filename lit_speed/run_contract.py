"""What a component may report to the runner: the declared contract behind the start-up table and ``summary.json``.

Every protocol here is optional and ``runtime_checkable``: :mod:`lit_speed.run.runner` asks ``isinstance(part,
StartupReport)`` and the like, and an object that implements none of them is simply not reported. Components
never import the runner, and the runner holds no code for a particular workload or component: a component that
wants a row, a summary entry or an end-of-run number implements the matching protocol.

Who reports what (checked by ``tests/run/test_run_contract.py``):

- :class:`StartupReport` (``describe()``): the datamodules, GuardedPrecision, ZeroStrategy and the callbacks.
- :class:`SummaryReport` (``final_summary()``): GuardedPrecision (and its ZeRO form), ZeroStrategy and the
  callbacks; stored under ``summary.json["components"][<class name>]``.
- :class:`AccumulationReport` (``current_factor``, ``factors``): AccumulationScheduler; the runner shows the
  factor in the effective-batch row and :class:`~lit_speed.run.plan_check.RunPlanCheck` checks the largest one.
- :class:`AccumulationPlan` (``accumulation_plan(micro_batch, world_size)``): AccumulationScheduler; the factor at the
  start and where the schedule goes, for the effective-batch row (a schedule the micro-batch cannot hold is refused).
- :class:`WorkloadReport` (``summary_extras()``): a workload's own reference numbers (CharLMDataModule's unigram
  baseline), stored at the top level of ``summary.json`` and shown in the end-of-run table.
- :class:`MonitoredModel` (``monitor``, ``monitor_mode``): the metric a model logs, the default of the
  ``monitor=`` / ``monitor_mode=`` settings.
- :class:`MonitorFollower` (``follow_monitor(monitor, mode)``): a callback that follows the run's metric and takes
  the one chosen at the first validation when none was named (RunSummary, BestAndLastCheckpoint).
- :class:`EndOfRunReport` (``end_rows()``): rows for the end-of-run table (DeviceStatsLogger: throughput and MFU).
- :class:`BatchSource` (``batch_kind``) and :class:`BatchConsumer` (``accepted_batch_kinds``): what a DataModule
  yields and what a model's ``training_step`` takes, class attributes read before anything is built
  (``lit_speed.run.config_rules.check_data_model`` refuses a pair that does not fit; a class that declares nothing is
  not checked).
- :class:`TokenSource` (``token_limits()``) and :class:`TokenModel` (classmethod ``input_limits(config)``): the ids and
  window a token DataModule yields (TextFolderDataModule: its tokenizer; CharLMDataModule) and the embedding rows and
  positions a model has (HFCausalLM from ``config.json``, GPTModule), compared before the model's weights load
  (``lit_speed.run.model_checks.check_tokens_fit_model``).
- :class:`ModelPreparer` (``prepare_model(model)``): a callback that changes the model before training (InitWeights
  loads weights, PEFTAdapters adds adapters and freezes the base; ExportModel only notes whether it holds a Hugging
  Face model); the runner calls it, in callback order, right after building the model, so the start-up table shows
  the model that trains and a refusal is a ``Config error``.

Example::

    class MyCallback(Callback):
        def describe(self) -> dict[str, str]:
            return {"my callback": "on, every 10 steps"}

        def final_summary(self) -> dict[str, Any]:
            return {"events": self.events}
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Protocol, runtime_checkable


@runtime_checkable
class StartupReport(Protocol):
    """A component that adds rows to the start-up table.

    ``describe()`` returns ``{row label: value}``; the runner writes ``str(value)`` (keep values short, one line).
    A strategy whose rows depend on the model it will train may take it as an optional argument,
    ``describe(model=None)``: the runner passes the model to the Trainer's strategy only, because the
    strategy has not seen the model when the table is printed (before ``fit``).
    """

    def describe(self) -> Mapping[str, object]:
        """Rows for the start-up table: ``{label: value}``."""


@runtime_checkable
class SummaryReport(Protocol):
    """A component that reports end-of-run facts.

    ``final_summary()`` returns a JSON-serialisable dict (numbers, strings, booleans, None, lists and dicts of
    those); the runner stores it under ``summary.json["components"][type(component).__name__]``.
    """

    def final_summary(self) -> dict[str, Any]:
        """End-of-run facts for ``summary.json``."""


@runtime_checkable
class AccumulationReport(Protocol):
    """A callback that schedules gradient accumulation itself (instead of ``Trainer(accumulate_grad_batches=)``).

    ``current_factor`` is the micro-batches per optimizer step now (per process); ``factors`` is the schedule
    ``{position: factor}`` when it is given in micro-batches, else ``None`` (a schedule in samples or tokens).
    """

    @property
    def current_factor(self) -> int:
        """Micro-batches per optimizer step in the current window."""

    @property
    def factors(self) -> Mapping[int, int] | None:
        """The scheduled factors by position, or ``None`` when the schedule is not in micro-batches."""


@runtime_checkable
class AccumulationPlan(Protocol):
    """An accumulation callback that can say, before training, what its schedule does for a micro-batch and a world
    size: ``accumulation_plan(micro_batch, world_size)`` returns the micro-batches per optimizer step at the start,
    the largest it reaches, and where the schedule goes from there (``""``: nowhere, one factor for the whole run),
    and raises ``ValueError``
    for a schedule that cannot hold at that micro-batch (an effective batch it does not divide). ``micro_batch`` is
    ``None`` when not known before setup. The runner prints it in the effective-batch row.
    """

    def accumulation_plan(self, micro_batch: int | None, world_size: int) -> tuple[int, int, str]:
        """``(factor at the start, largest factor, what follows)``."""


class SummaryExtra(NamedTuple):
    """One reference number a workload reports: its ``summary.json`` key, its end-of-run table label, its value."""

    key: str
    label: str
    value: float


@runtime_checkable
class WorkloadReport(Protocol):
    """A datamodule or model with reference numbers of its own (e.g. the loss a unigram model would reach).

    ``summary_extras()`` returns :class:`SummaryExtra` entries; each ``key`` goes to the top level of
    ``summary.json``, each ``label`` becomes a row of the end-of-run table (value with 4 decimals).
    """

    def summary_extras(self) -> list[SummaryExtra]:
        """Reference numbers for ``summary.json`` and the end-of-run table."""


@runtime_checkable
class MonitoredModel(Protocol):
    """A LightningModule that names the metric it logs for checkpointing, early stopping and sweeps."""

    monitor: str
    monitor_mode: str  # "max" or "min"


@runtime_checkable
class MonitorFollower(Protocol):
    """A callback that follows the run's monitored metric (best value, best checkpoint).

    ``follow_monitor(monitor, mode)`` is called once, at the end of the first validation, when neither the config
    nor the model named a metric and the runner chose one from the logged metrics
    (:func:`lit_speed.run.monitor.choose_monitor`); a callback that already follows one keeps it.
    """

    def follow_monitor(self, monitor: str, mode: str) -> None:
        """Follow ``monitor`` (``"min"`` or ``"max"`` is better) from now on."""


@runtime_checkable
class EndOfRunReport(Protocol):
    """A component that adds rows to the end-of-run table (``{label: value}``, values one short line each)."""

    def end_rows(self) -> Mapping[str, object]:
        """Rows for the end-of-run table."""


@runtime_checkable
class PhaseTimer(Protocol):
    """A component that spends wall time outside the training steps and says how much (``{phase: seconds}``),
    e.g. ``{"export": 41.2}`` or ``{"checkpoints": 3.1}``: ``summary.json``'s time split takes it out of the
    training time. Asked of the callbacks, the strategy and its checkpoint IO after fit."""

    def phase_seconds(self) -> Mapping[str, float]:
        """Seconds spent so far in each phase this component owns."""


@runtime_checkable
class BatchSource(Protocol):
    """A DataModule that names the kind of batch it yields, as ``"<inputs>-><targets>"``.

    Bundled: ``"features->class"`` (digits: float features, class indices), ``"tokens->next-token"`` (charlm).
    Pick a name of your own for a new kind; a wrapper (a curriculum) yields what the DataModule it wraps yields.
    """

    batch_kind: str


@runtime_checkable
class BatchConsumer(Protocol):
    """A LightningModule that names the batch kinds its ``training_step`` takes (see :class:`BatchSource`)."""

    accepted_batch_kinds: tuple[str, ...]


@runtime_checkable
class ModelPreparer(Protocol):
    """A callback that transforms the model before the optimizer exists (weights, adapters, frozen parameters).

    ``prepare_model(model)`` must be idempotent: the runner calls it after building the model, and the callback's
    own ``setup`` calls it again (which is how it works in a plain ``Trainer``).
    """

    def prepare_model(self, model: Any) -> None:
        """Transform ``model`` in place (once)."""


class TokenLimits(NamedTuple):
    """The token ids and the window of a DataModule, or the ids and positions a model can take.

    ``vocab_size``: ids are ``0 .. vocab_size - 1`` (data), or the model's embedding rows. ``positions``: the window
    (``block_size``) of the data, or the positions the model has (``None``: no limit). ``source``: the argument that
    sets the vocabulary, as ``name=value`` (the runner puts the config path in front; ``""``: a fixed vocabulary).
    ``kind``: for a model, how it encodes positions: ``"learned"`` (a table: no position past it exists),
    ``"rotary"`` (computed: runs past it, at positions it never trained on) or ``""``. ``name``: what to call it in a
    message (a model's architecture, a fixed vocabulary). ``positions_source``: the argument that sets ``positions``
    (``""``: ``source``).
    """

    vocab_size: int
    positions: int | None
    source: str
    kind: str = ""
    name: str = ""
    positions_source: str = ""


@runtime_checkable
class TokenSource(Protocol):
    """A DataModule of token ids that can say, before ``setup``, how many ids its tokenizer has and its window.

    ``token_limits()`` may load the tokenizer (cheap next to the model's weights) and raises ``ValueError`` naming its
    argument when it cannot (a folder without a usable tokenizer). The runner asks it right after building the
    DataModule, before the model is built (:func:`lit_speed.run.model_checks.check_tokens_fit_model`).
    """

    def token_limits(self) -> TokenLimits:
        """The vocabulary and window of the ids this DataModule will yield."""


@runtime_checkable
class TokenModel(Protocol):
    """A LightningModule class that can say, from its constructor arguments alone (before its weights load), how many
    token ids its embedding has and how many positions it takes: ``input_limits(config)`` is a classmethod given the
    model's config node as a dict; ``None`` when it cannot tell (a hub id offline)."""

    @classmethod
    def input_limits(cls, config: Mapping[str, Any]) -> TokenLimits | None:
        """The embedding rows and positions of the model ``config`` would build."""


def startup_rows_of(part: object, *args: Any) -> dict[str, str]:
    """``part.describe(*args)`` with labels and values as strings; ``{}`` when ``part`` reports no rows."""
    if not isinstance(part, StartupReport):
        return {}
    return {str(label): str(value) for label, value in part.describe(*args).items()}
