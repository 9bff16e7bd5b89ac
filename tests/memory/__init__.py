"""Tests of ``lit_speed.memory``."""
