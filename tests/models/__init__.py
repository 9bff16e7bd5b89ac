"""Tests of ``lit_speed.models``."""
