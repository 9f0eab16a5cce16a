"""The docs as a reference: their sizes, no run histories, links that resolve, and the server's flags documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvrelay.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
SESSION = re.compile(r"session [0-9]+", re.I)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_readme_and_benchmarks_stay_a_reference():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300
    assert len((ROOT / "BENCHMARKS.md").read_text().splitlines()) <= 500


def session_mentions(paths: list[Path]) -> list[str]:
    return [f"{p}:{i}" for p in paths for i, line in enumerate(p.read_text().splitlines(), 1) if SESSION.search(line)]


def test_no_session_numbers_in_the_package_or_the_docs():
    package = sorted((ROOT / "kvrelay").rglob("*.py"))
    assert session_mentions(package + [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]) == []


def test_the_session_check_sees_one(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("a session of work\nas measured in Session 12\n")
    assert session_mentions([doc]) == [f"{doc}:2"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        path = (doc.parent / target).resolve()
        if not path.exists():
            broken.append(target)
    assert broken == []


def test_every_serve_flag_is_in_docs_serving():
    parser = build_parser()
    serve = next(a for a in parser._subparsers._group_actions if hasattr(a, "choices")).choices["serve"]
    flags = [s for action in serve._actions for s in action.option_strings if s.startswith("--") and s != "--help"]
    text = (ROOT / "docs" / "serving.md").read_text()
    missing = [f for f in flags if f"`{f}`" not in text and not (f.startswith("--no-") and f"`--{f[5:]}`" in text)]
    assert missing == []


def test_default_max_tokens_names_the_same_parameters_in_help_and_docs():
    """A client reads either: both name every request parameter that sets a request's own bound."""
    parser = build_parser()
    serve = next(a for a in parser._subparsers._group_actions if hasattr(a, "choices")).choices["serve"]
    help_text = next(a.help for a in serve._actions if "--default-max-tokens" in a.option_strings)
    row = next(line for line in (ROOT / "docs" / "serving.md").read_text().splitlines()
               if line.startswith("| `--default-max-tokens`"))
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        assert name in help_text and f"`{name}`" in row, name


def test_every_flag_with_a_default_says_it_in_its_help():
    """`kvrelay <cmd> --help` is where a user reads a flag's default: every flag that has one (other than off or
    empty) says it."""
    parser = build_parser()
    commands = next(a for a in parser._subparsers._group_actions if hasattr(a, "choices")).choices
    silent = [f"{name} {action.option_strings[0]}" for name, command in commands.items()
              for action in command._actions
              if action.option_strings and action.help and action.default not in (None, False, "", [])
              and action.dest != "help" and "default" not in action.help]
    assert silent == []


PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_examples_compile_as_scripts(doc):
    """A user pastes a doc's example into a file and runs it: it must at least be a valid script (a top-level
    ``await``, which only a notebook takes, is not)."""
    for i, block in enumerate(PYTHON_BLOCK.findall(doc.read_text())):
        compile(block, f"{doc.name}: python block {i + 1}", "exec")
