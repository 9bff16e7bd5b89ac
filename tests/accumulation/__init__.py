"""Tests of ``lit_speed.accumulation``."""
