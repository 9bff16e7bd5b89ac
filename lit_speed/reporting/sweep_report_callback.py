"""Hydra callback: keep ``sweep_report.{md,csv,png}`` up to date in the sweep folder of every ``-m`` run."""
from __future__ import annotations

import logging
import traceback
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig
from typing_extensions import override

from lit_speed.reporting.sweep_report import ERROR_FILE, write_report

log = logging.getLogger(__name__)


class SweepReportCallback(Callback):
    """Writes the sweep report after every job and once more when the multirun ends.

    Writing after each job (not only in ``on_multirun_end``) matters: Hydra's sweepers re-raise the
    first failed job's exception once its batch is done, so ``on_multirun_end`` never runs for a sweep
    with a failure; the report then still holds every job, the failed one marked with its error.
    Works with any sweeper that writes one folder per job under ``hydra.sweep.dir`` (basic, Optuna).
    Single runs (no ``-m``) are left alone.

    Args:
        enabled: Set ``false`` to switch the report off (``hydra.callbacks.sweep_report.enabled=false``).
        title: Heading of ``sweep_report.md`` (default: the sweep folder's name).

    Example::

        # conf/hydra/default.yaml
        callbacks:
          sweep_report:
            _target_: lit_speed.reporting.SweepReportCallback
        # then: python scripts/train.py -m precision=32-true,bf16-mixed
    """

    def __init__(self, enabled: bool = True, title: str | None = None) -> None:
        if not isinstance(enabled, bool):
            raise ValueError(f"hydra.callbacks.sweep_report.enabled must be true or false, got {enabled!r}")
        self.enabled = enabled
        self.title = title

    @override
    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if not self.enabled or config.hydra.mode != RunMode.MULTIRUN:
            return
        if job_return.status == JobStatus.FAILED:
            error: BaseException | None = None
            try:
                job_return.return_value  # noqa: B018 - re-raises the job's exception (public API; no private field)
            except Exception as raised:  # noqa: BLE001 - any job error is recorded, none is swallowed by Hydra
                error = raised
            out = Path(config.hydra.runtime.output_dir)
            if error is not None:
                text = "".join(traceback.format_exception_only(type(error), error)).strip()
                (out / ERROR_FILE).write_text(text + "\n")
        self._write(config.hydra.sweep.dir, final=False)

    @override
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.enabled:
            self._write(config.hydra.sweep.dir, final=True)

    def _write(self, sweep_dir: str, final: bool) -> None:
        try:
            paths = write_report(sweep_dir, self.title)
        except Exception as error:  # noqa: BLE001 - a report problem must never fail the user's sweep
            log.warning(f"sweep report not written to {sweep_dir}: {type(error).__name__}: {error}")
            return
        if final:
            log.info(f"sweep report: {paths['md']} (+ .csv, .png)\n{paths['md'].read_text()}")
