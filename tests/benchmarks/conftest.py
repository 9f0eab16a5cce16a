"""The benchmark scripts import their siblings by bare name (they run as ``python benchmarks/X.py``)."""

import sys
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)
