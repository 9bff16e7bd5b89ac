"""The error type of configuration mistakes the user can fix (its own module: the runner's checks import it)."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration the user can fix; the message names the setting, the choices and the fix."""


class RunStopped(RuntimeError):
    """A run stopped for a reason the user can act on after it started (a checkpoint that could not be written):
    the message says what happened, what was kept and how to go on; ``exit_code`` is the process's exit status."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code
