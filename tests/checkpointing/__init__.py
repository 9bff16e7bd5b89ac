"""Tests of ``lit_speed.checkpointing``."""
