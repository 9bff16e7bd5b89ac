"""Tests of ``lit_speed.optim``: the optimizers, their declared state, the LR schedules."""
