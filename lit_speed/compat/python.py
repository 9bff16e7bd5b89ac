"""CPython's private ``atexit._run_exitfuncs``: the exit hooks run now, in the order Python would run them at exit.

Written against CPython 3.11 (present since 3.0; ``Py_FinalizeEx`` runs the same hooks through it). It calls every
registered hook once, last registered first, prints a hook's exception and goes on, and clears the list.
"""
from __future__ import annotations

import atexit


def run_exit_hooks() -> None:
    """Run (and clear) every ``atexit`` hook now, as the interpreter would at a normal exit."""
    atexit._run_exitfuncs()
