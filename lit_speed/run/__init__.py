"""The Hydra runner: compose the pieces a config describes into a ``Trainer``, check them first, and report.

``scripts/train.py`` calls :func:`lit_speed.run.config_check.preflight` (the command line) and
:func:`lit_speed.run.runner.train` (the composed config). This package is the top floor: it may import every
component, and no component imports it (``tests/test_architecture.py``). Its modules are not imported here, so
``import lit_speed.run`` is cheap.
"""
