"""Tests of ``lit_speed.strategies``."""
