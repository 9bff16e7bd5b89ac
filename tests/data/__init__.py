"""Tests of ``lit_speed.data``."""
