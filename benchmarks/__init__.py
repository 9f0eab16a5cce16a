"""Benchmark entry points that reproduce the reference tables in BENCHMARKS.md (docs/benchmarks.md).

Imported as a package only by import-linter and the tests; the scripts run as ``python benchmarks/X.py``.
"""
