"""Deprecated location of :class:`~lit_speed.models.lion.Lion`, which moved next to the other optimizers.

``from lit_speed.memory.lion import Lion`` keeps working for one release and emits a ``DeprecationWarning`` that
names the new path; import it from ``lit_speed.models.lion`` (or ``lit_speed.Lion``) instead.
"""
from __future__ import annotations

import warnings
from typing import Any

import lit_speed  # the public names: a component package does not import another one directly

NEW_PATH = "lit_speed.models.lion"


def __getattr__(name: str) -> Any:
    if name != "Lion":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"{__name__}.Lion moved to {NEW_PATH}.Lion; import it from there (or lit_speed.Lion). "
                  f"{__name__} will be removed in the next release.", DeprecationWarning, stacklevel=2)
    return lit_speed.Lion
