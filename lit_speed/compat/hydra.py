"""Hydra's command-line flags and config search path, built as ``@hydra.main`` builds them, and its composition
handed to the pre-flight (hydra-core 1.3.8).

``scripts/train.py`` checks a command line before ``@hydra.main`` runs (:func:`lit_speed.run.config_check.preflight`),
so it must compose from the same folders Hydra will: the main config folder (``--config-path`` or the decorator's
``config_path``), ``--config-dir``, and any ``hydra.searchpath`` entries. Hydra builds that search path in
``hydra._internal.utils._run_hydra`` from private helpers; the ones used here are the same, each named below
and pinned by ``tests/compat/test_compat.py``.
"""
from __future__ import annotations

import argparse
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from hydra._internal.hydra import Hydra
from hydra._internal.utils import create_automatic_config_search_path, get_args_parser
from hydra.core.config_search_path import SearchPathQuery
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, open_dict

HYDRA_VERSION = "1.3.8"  # the version these helpers were written and tested against


def parse_command_line(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """``argv`` read by Hydra's own parser (``hydra._internal.utils.get_args_parser``): ``overrides``,
    ``config_path``, ``config_name``, ``config_dir``, ``multirun``, ...; and the arguments it does not recognise,
    which ``@hydra.main`` refuses (e.g. overrides on both sides of a flag: ``a=1 --config-dir d b=2``)."""
    args, unrecognized = get_args_parser().parse_known_args(list(argv))
    return args, unrecognized


@contextmanager
def initialized_like_main(calling_file: str, config_path: str | None, config_dir: str | None = None,
                          job_name: str = "app") -> Iterator[None]:
    """``GlobalHydra`` initialised with the search path ``@hydra.main(config_path=config_path)`` in
    ``calling_file`` builds, with ``--config-dir config_dir`` prepended before the schema source as
    ``_run_hydra`` does; the previous ``GlobalHydra`` state is restored on exit.

    Args:
        calling_file: The Python file that declares ``@hydra.main`` (relative ``config_path`` values are relative
            to its folder).
        config_path: ``config_path`` of the decorator, or ``--config-path`` (absolute, relative or ``pkg://``).
        config_dir: ``--config-dir``: an additional folder searched after the main one.

    Raises:
        NotADirectoryError: If ``config_dir`` is not a folder (Hydra refuses it the same way).
    """
    search_path = create_automatic_config_search_path(calling_file, None, config_path)
    if config_dir is not None:
        absolute = os.path.abspath(config_dir)
        if not os.path.isdir(absolute):
            raise NotADirectoryError(absolute)
        search_path.prepend(provider="command-line", path=f"file://{absolute}",
                            anchor=SearchPathQuery(provider="schema"))
    instance = GlobalHydra.instance()
    previous = instance.hydra  # restored on exit, as hydra.initialize* restores its backup
    instance.clear()
    Hydra.create_main_hydra2(task_name=job_name, config_search_path=search_path)
    try:
        yield
    finally:
        instance.clear()
        if previous is not None:
            instance.initialize(previous)


@contextmanager
def on_main_composition(composed: Callable[[DictConfig], None],
                        failed: Callable[[BaseException], None]) -> Iterator[None]:
    """Compose a single run's config once for ``@hydra.main``, hand it to ``composed`` before the job runs (before
    Hydra makes the run folder), and a composition error to ``failed`` before Hydra reports it.

    ``@hydra.main`` composes through ``hydra._internal.hydra.Hydra.compose_config`` (private) twice for one run:
    ``Hydra.get_mode`` composes in multirun mode, without validating sweeps, only to read ``hydra.mode``, then
    ``Hydra.run`` composes again. Here ``get_mode``'s call composes the run's config (run mode, sweeps validated, as
    ``Hydra.run`` asks), and ``Hydra.run``'s call gets that composition back through its config loader, with Hydra's
    logging set up as usual. Where ``get_mode``'s call is not made (``--cfg``, ``--help``), the first composition is
    handed to ``composed``. A composition that fails goes to ``failed``, then Hydra composes and reports as it would.
    Exceptions from ``composed`` and ``failed`` reach Hydra's reporting: end the process (``sys.exit``) to report in
    your own words. Not for ``--multirun`` (a sweep composes each job). ``Hydra.compose_config`` is restored on exit.
    """
    from hydra.types import RunMode

    original = Hydra.compose_config
    state: dict[str, Any] = {"first": True, "kept": None}

    def compose_config(self: Hydra, config_name: str | None, overrides: list[str], run_mode: RunMode,
                       with_log_configuration: bool = False, from_shell: bool = True,
                       validate_sweep_overrides: bool = True) -> DictConfig:
        kept, state["kept"] = state["kept"], None
        if kept is not None and run_mode == RunMode.RUN and _same_run(kept, config_name, overrides):
            cfg = kept[2]
            if len(overrides) > len(kept[1]):  # _run_app's hydra.mode=RUN, as composing it would have set it
                with open_dict(cfg):
                    cfg.hydra.mode = RunMode.RUN
                    cfg.hydra.overrides.hydra.append(MODE_RUN)
            loader = self.config_loader
            loader.load_configuration = lambda **_: cfg  # Hydra.run's composition: the one made already
            try:
                return original(self, config_name, overrides, run_mode, with_log_configuration, from_shell,
                                validate_sweep_overrides)
            finally:
                del loader.load_configuration
        if not state["first"]:
            return original(self, config_name, overrides, run_mode, with_log_configuration, from_shell,
                            validate_sweep_overrides)
        state["first"] = False
        asks_mode = run_mode == RunMode.MULTIRUN and not validate_sweep_overrides  # Hydra.get_mode's call
        try:
            cfg = original(self, config_name, overrides, RunMode.RUN if asks_mode else run_mode,
                           with_log_configuration, from_shell, True if asks_mode else validate_sweep_overrides)
        except Exception as error:
            failed(error)
            if not asks_mode:
                raise
            return original(self, config_name, overrides, run_mode, with_log_configuration, from_shell,
                            validate_sweep_overrides)
        composed(cfg)
        if asks_mode:
            state["kept"] = (config_name, list(overrides), cfg)
        return cfg

    Hydra.compose_config = compose_config
    try:
        yield
    finally:
        Hydra.compose_config = original


#: The override ``hydra._internal.utils._run_app`` adds for a single run whose config sets no ``hydra.mode``.
MODE_RUN = "hydra.mode=RUN"


def _same_run(kept: tuple[str | None, list[str], DictConfig], config_name: str | None, overrides: list[str]) -> bool:
    """Whether ``Hydra.run``'s composition asks for the kept one: the same config and overrides, with ``_run_app``'s
    ``hydra.mode=RUN`` added where the config sets no mode."""
    name, kept_overrides, cfg = kept
    extra = list(overrides[len(kept_overrides):])
    return name == config_name and list(overrides[:len(kept_overrides)]) == kept_overrides and \
        (extra == [] or (extra == [MODE_RUN] and cfg.hydra.get("mode") is None))
