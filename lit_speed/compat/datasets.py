"""Hugging Face ``datasets``' offline switch (datasets 5.2).

``datasets.config.HF_HUB_OFFLINE`` is read when a dataset is resolved: set, ``load_dataset`` looks in the local cache
only and fails at once (``OfflineModeIsEnabled``) instead of retrying an unreachable Hub for about half a minute.
The environment variable ``HF_HUB_OFFLINE`` is read once, at import, so a run that finds the Hub unreachable after
the import sets the module's value for the call and puts it back.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


@contextmanager
def hub_offline(offline: bool) -> Iterator[None]:
    """``datasets`` resolves from its local cache only inside the block when ``offline`` (else as it was)."""
    import datasets.config

    before = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = before or offline
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = before
