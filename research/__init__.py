"""Studies, oracles and calibration searches behind kvrelay's defaults (see research/README.md).

Outside the package: research may import kvrelay, never the reverse (import-linter in pyproject.toml), and CI only
compiles these files (tests/benchmarks/test_research_compiles.py). The scripts import their siblings by bare name:
run them as ``python research/X.py``; their tests as ``pytest research/tests``.
"""
