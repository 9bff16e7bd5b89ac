"""Tests of the Hydra runner: scripts/train.py, config groups, bad input, launch paths, selfcheck."""
