"""Benchmarks: measurements with a baseline beside them, run from `pdserve bench ...`, not from pytest."""
