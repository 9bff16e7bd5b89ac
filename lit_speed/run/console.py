"""What the runner keeps off the console: upstream notices printed on every run that the user did not ask for and
cannot act on. Each is matched by its exact text, so every other message of those libraries still shows.

Only ``scripts/train.py`` and ``scripts/plan.py`` (and :func:`lit_speed.run.runner.train`) install these; a plain
``Trainer`` with lit_speed's components prints what Lightning prints.
"""
from __future__ import annotations

import logging
import re
import warnings

# Lightning 2.6.6 (_LoggerConnector.configure_logger) logs this at INFO through rank_zero_info whenever no LitLogger
# is among the loggers, i.e. on every run. It has no switch of its own; a logging.Filter on the logger it goes
# through (the rank-zero logger, named after the module that set it last) is the standard way to drop one record.
LIGHTNING_TIP = "💡 Tip: For seamless cloud logging"
RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")
# Lightning 2.6.6's lightning/pytorch/utilities/_pytree.py builds torch's LeafSpec, which torch 2.13 deprecates: a
# FutureWarning about Lightning's own code, printed on every run (the fix is Lightning's)
LEAFSPEC_DEPRECATION = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
# Lightning 2.6.6's strategy.all_gather (lightning/fabric/utilities/distributed.py) calls torch's deprecated
# torch.distributed.nn.functional.all_gather: one FutureWarning per process of every multi-process run (Lightning's fix)
ALL_GATHER_DEPRECATION = r"torch\.distributed\.nn\.functional\.all_gather is deprecated"
# transformers 5.24 imports torchao whenever it is installed (its quantizer registry, on `import transformers`), and
# that import logs five lines on every Hugging Face run about what no lit_speed option uses: torchao's mxfp8 and
# sm90a cutlass builds that do not load here, its triton kernels, and torch's deprecation of register_constant() for
# each Enum torchao registers with pytree. Each is said once, at import: dropping it then drops it for good.
IMPORT_NOISE = {
    "torchao": r"^Failed to load \S*torchao\S*\.so",
    "torchao.kernel.intmm": r"^Warning: Detected no triton, on systems without Triton certain kernels will not work",
    "torch.utils._pytree": r"is an Enum subclass and is now natively supported by torch\.compile as an opaque value "
                           r"type\. Calling register_constant\(\) on Enum subclasses is deprecated",
}


class _DropMessage(logging.Filter):
    """Drops the records whose message matches ``pattern`` (``re.search``)."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return re.search(self.pattern, str(record.getMessage())) is None


def _drop(logger_name: str, pattern: str) -> None:
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, _DropMessage) and f.pattern == pattern for f in logger.filters):
        logger.addFilter(_DropMessage(pattern))


def quiet_upstream_notices() -> None:
    """Drop Lightning's litlogger tip, torch's deprecation of a name Lightning uses, and the lines torchao's import
    logs through transformers (:data:`IMPORT_NOISE`) (idempotent; call it before anything imports transformers)."""
    for name in RANK_ZERO_LOGGERS:
        _drop(name, "^" + re.escape(LIGHTNING_TIP))
    for name, pattern in IMPORT_NOISE.items():
        _drop(name, pattern)
    warnings.filterwarnings("ignore", message=LEAFSPEC_DEPRECATION, category=FutureWarning)
    warnings.filterwarnings("ignore", message=ALL_GATHER_DEPRECATION)
