"""Data lives in kvrelay.data; pipeline code never imports eval (the dependency runs eval -> pipeline)."""

import ast
import importlib.util
from pathlib import Path

import kvrelay

ROOT = Path(kvrelay.__file__).parent


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    return found | {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}


def test_pipeline_never_imports_eval():
    offenders = {p.name: sorted(m for m in _imports(p) if m.startswith("kvrelay.eval"))
                 for p in (ROOT / "pipeline").glob("*.py")}
    assert not any(offenders.values()), offenders


def test_datasets_and_scoring_live_in_data():
    assert importlib.util.find_spec("kvrelay.data.datasets") and importlib.util.find_spec("kvrelay.data.scoring")
    assert not (ROOT / "eval" / "datasets.py").exists() and not (ROOT / "eval" / "scoring.py").exists()
