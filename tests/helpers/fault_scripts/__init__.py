"""Fault-injection callbacks and runners; Hydra targets name them as ``tests.helpers.fault_scripts.<module>``."""
