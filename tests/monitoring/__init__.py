"""Tests of ``lit_speed.monitoring``."""
