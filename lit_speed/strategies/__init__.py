"""Distributed strategies: :class:`~lit_speed.strategies.zero_strategy.ZeroStrategy` (DeepSpeed ZeRO 1-3)."""
