"""The product boundary: benchmarks/ uses kvrelay's public surface only, and research/ at least compiles.

import-linter (pyproject.toml) checks which packages import which; these check what it cannot: that no benchmark
imports or reaches into a private name (``_x``) of another module, and that every research script still compiles
(research/ is outside CI otherwise: its own tests run with ``pytest research/tests``).
"""

from __future__ import annotations

import ast
import py_compile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = sorted((ROOT / "benchmarks").glob("*.py"))
RESEARCH = sorted((ROOT / "research").rglob("*.py"))
# Private names of third-party libraries with no public way to them, each with its reason.
THIRD_PARTY = {("llamacpp_peers.py", "._ctx"): "llama-cpp-python exposes its llama_context only as Llama._ctx"}
# a profiler times the connector's own steps by wrapping them: what it reads is the inside it measures
PROFILER = {("vllm_load_parts.py", name): "wraps the connector's internal steps to time them"
            for name in ("._worker", "._saver", "._call", "._run_layer")}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(source: str) -> list[str]:
    """Each private name a module imports, or reads off an object other than its own ``self``/``cls``, as
    ``line: name``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            parts = (node.module or "").split(".")
            names = [a.name for a in node.names]
            found += [f"{node.lineno}: {node.module}" for p in parts if _private(p)]
            found += [f"{node.lineno}: {node.module}.{n}" for n in names if _private(n)]
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: {a.name}" for a in node.names if any(map(_private, a.name.split(".")))]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                found.append(f"{node.lineno}: .{node.attr}")
    return found


def test_the_check_sees_each_kind_of_private_use():
    source = ("from kvrelay.reuse.relay import _estimate\nfrom kvrelay._impl import x\nimport kvrelay._impl\n"
              "pool = method._pool\nself._mine = 1\nfrom kvrelay.reuse import get_method\n")
    assert private_uses(source) == ["1: kvrelay.reuse.relay._estimate", "2: kvrelay._impl", "3: kvrelay._impl",
                                    "4: ._pool"]


def test_the_benchmarks_glob_finds_the_entry_points():
    names = {p.name for p in BENCHMARKS}
    assert {"bench_engine.py", "make_tables.py", "serve_chain.py"} <= names


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_benchmarks_use_no_private_names(path):
    allowed = THIRD_PARTY | PROFILER
    found = [use for use in private_uses(path.read_text()) if (path.name, use.split(": ")[1]) not in allowed]
    assert found == [], f"{path.name} uses private names of other modules"


@pytest.mark.parametrize("path", RESEARCH, ids=lambda p: str(p.relative_to(ROOT)))
def test_research_compiles(path, tmp_path):
    py_compile.compile(str(path), cfile=str(tmp_path / "x.pyc"), doraise=True)
