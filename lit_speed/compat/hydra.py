"""Hydra's command-line flags and config search path, built as ``@hydra.main`` builds them (hydra-core 1.3.8).

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
from typing import Iterator, Sequence

from hydra._internal.hydra import Hydra
from hydra._internal.utils import create_automatic_config_search_path, get_args_parser
from hydra.core.config_search_path import SearchPathQuery
from hydra.core.global_hydra import GlobalHydra

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
