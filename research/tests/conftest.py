"""The study scripts import their siblings by bare name (they run as ``python research/X.py``)."""

import sys
from pathlib import Path

RESEARCH = str(Path(__file__).resolve().parents[1])
if RESEARCH not in sys.path:
    sys.path.insert(0, RESEARCH)
