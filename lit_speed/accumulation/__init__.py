"""Gradient accumulation scheduled per optimizer step, token-correct, with automatic micro-batch sizing."""
from lit_speed.accumulation.accumulation_scheduler import AccumulationScheduler

__all__ = ["AccumulationScheduler"]
