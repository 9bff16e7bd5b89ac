"""What the runner keeps off the console: upstream notices printed on every run that the user did not ask for and
cannot act on. Each is matched by its exact text, so every other message of those libraries still shows.

Only ``scripts/train.py`` (:func:`lit_speed.run.runner.train`) installs these; a plain ``Trainer`` with lit_speed's
components prints what Lightning prints.
"""
from __future__ import annotations

import logging
import warnings

# Lightning 2.6.6 (_LoggerConnector.configure_logger) logs this at INFO through rank_zero_info whenever no LitLogger
# is among the loggers, i.e. on every run. It has no switch of its own; a logging.Filter on the logger it goes
# through (the rank-zero logger, named after the module that set it last) is the standard way to drop one record.
LIGHTNING_TIP = "💡 Tip: For seamless cloud logging"
RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")
# Lightning 2.6.6's lightning/pytorch/utilities/_pytree.py builds torch's LeafSpec, which torch 2.13 deprecates: a
# FutureWarning about Lightning's own code, printed on every run (the fix is Lightning's)
LEAFSPEC_DEPRECATION = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(self.prefix)


def quiet_upstream_notices() -> None:
    """Drop Lightning's litlogger tip and torch's deprecation of a name Lightning uses (idempotent)."""
    for name in RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.prefix == LIGHTNING_TIP for f in logger.filters):
            logger.addFilter(_DropMessage(LIGHTNING_TIP))
    warnings.filterwarnings("ignore", message=LEAFSPEC_DEPRECATION, category=FutureWarning)
