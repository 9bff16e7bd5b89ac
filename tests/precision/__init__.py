"""Tests of ``lit_speed.precision``."""
