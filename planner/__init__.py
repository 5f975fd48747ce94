"""Sizing and scaling the pools: worker profiles, the simulator, the planner and the autoscaler's
decisions. Pure: imports no torch (tests/unit/test_pure_imports.py)."""
