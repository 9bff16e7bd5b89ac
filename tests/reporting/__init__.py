"""Tests of ``lit_speed.reporting``."""
