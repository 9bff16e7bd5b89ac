"""Private details of torchmetrics' ``Metric`` (torchmetrics 1.9).

A metric's accumulated state is public (``metric_state``, the attributes registered with ``add_state``); how many
updates made it is not settable (``update_count`` is read-only: ``Metric._update_count``), and ``compute()`` caches
its result in ``Metric._computed``. Restoring a state saved mid-epoch must set both, or ``compute()`` warns that it
ran before ``update()`` and, in a process group, skips the sync of the restored state.
"""
from __future__ import annotations

from typing import Any


def set_metric_state(metric: Any, state: dict[str, Any], update_count: int) -> None:
    """Put back what ``metric.metric_state`` and ``metric.update_count`` held (tensors moved to the metric's device)."""
    for name, value in state.items():
        current = getattr(metric, name)
        device = current.device if hasattr(current, "device") else (current[0].device if current else None)
        if hasattr(value, "to") and device is not None:
            value = value.to(device)
        elif isinstance(value, list) and device is not None:
            value = [v.to(device) for v in value]
        setattr(metric, name, value)
    metric._update_count = int(update_count)
    metric._computed = None
