"""Benchmark scripts that import ``benchmarks.`` modules start when run by path, as run_all.sh and the tables'
captions run them (``python benchmarks/X.py``), from any folder."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
PACKAGE_IMPORT = re.compile(r"^from benchmarks\.", re.M)
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py") if PACKAGE_IMPORT.search(p.read_text()))


def test_some_scripts_import_the_package():
    assert "llamacpp_side_by_side.py" in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_starts_by_path(script, tmp_path):
    out = subprocess.run([sys.executable, str(BENCHMARKS / script), "--help"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage:")
