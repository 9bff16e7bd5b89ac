"""lit_speed's test suite: one subpackage per ``lit_speed`` package, shared helpers in ``tests.helpers``."""
