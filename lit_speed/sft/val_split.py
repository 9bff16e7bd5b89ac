"""Which rows a data set without a validation file holds out: the same rows for the same data, whatever the run."""
from __future__ import annotations

import numpy as np

#: ``val_size="auto"``: this share of the rows, at least 1 and at most :data:`AUTO_MAX` (a validation pass at real
#: size on a CPU costs about a training step per few examples: a bounded set keeps it a small part of the run)
AUTO_SHARE, AUTO_MAX = 0.05, 128
SPLIT_SEED = 0  # the held-out rows do not move with the run's seed: another seed validates on the same examples


def check_val_size(val_size: int | float | str, owner: str = "SFTDataModule") -> int | float | str:
    """``val_size`` as given when it is ``auto``, an int >= 1 or a share in (0, 1).

    Raises:
        ValueError: Anything else, naming the setting and its forms.
    """
    ok = val_size == "auto" or (isinstance(val_size, int) and not isinstance(val_size, bool) and val_size >= 1) or \
        (isinstance(val_size, float) and 0.0 < val_size < 1.0)
    if not ok:
        raise ValueError(f"{owner}(val_size={val_size!r}): must be auto, a number of examples >= 1 or a share in "
                         "(0, 1). Fix: data.val_size=auto (5%, 1-128 examples), or data.val_source=<validation file>")
    return val_size


def held_out_rows(val_size: int | float | str, rows: int, owner: str = "SFTDataModule") -> np.ndarray:
    """Sorted indices of the rows held out for validation (a seeded draw; at least one row stays for training).

    Raises:
        ValueError: A data set of one row (nothing is left to train on), or a ``val_size`` that takes every row.
    """
    check_val_size(val_size, owner)
    if val_size == "auto":
        count = min(max(int(round(rows * AUTO_SHARE)), 1), AUTO_MAX)
    elif isinstance(val_size, float):
        count = max(int(round(rows * val_size)), 1)
    else:
        count = int(val_size)
    if count >= rows:
        raise ValueError(f"{owner}(val_size={val_size!r}): holds out {count} of {rows} examples, none left to "
                         "train on. Fix: a smaller data.val_size, or data.val_source=<a validation file>")
    return np.sort(np.random.default_rng(SPLIT_SEED).permutation(rows)[:count])
