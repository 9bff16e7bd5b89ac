"""Tests of ``lit_speed.curriculum``."""
