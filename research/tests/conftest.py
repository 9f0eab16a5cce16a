"""The study scripts import their siblings by bare name (they run as ``python research/X.py``). This folder has no
``__init__.py``, so that ``tests`` still names the repository's tests/ (``tests.helpers``) with research/ on the
path, as it is when a study runs as a script."""

import sys
from pathlib import Path

RESEARCH = str(Path(__file__).resolve().parents[1])
if RESEARCH not in sys.path:
    sys.path.append(RESEARCH)
