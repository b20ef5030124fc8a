"""Helpers shared by tests/ and benchmarks/: references, data generators, process launchers."""
