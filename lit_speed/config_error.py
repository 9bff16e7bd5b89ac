"""The error type of configuration mistakes the user can fix (its own module: the runner's checks import it)."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration the user can fix; the message names the setting, the choices and the fix."""
