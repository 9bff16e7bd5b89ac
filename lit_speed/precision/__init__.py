"""Mixed precision that stays finite: :class:`GuardedPrecision` and its functional core."""
from lit_speed.precision.guarded_precision import GuardedPrecision

__all__ = ["GuardedPrecision"]
