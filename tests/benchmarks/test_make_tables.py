"""BENCHMARKS.md's and docs/methods.md's tables are what ``benchmarks/make_tables.py`` makes from the committed JSON,
and the results kept in the tree are the ones those tables read, within the size budget."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import make_tables
from table_render import RESULTS, result_path

RESULTS_BUDGET_BYTES = 5 * 10**6


def test_the_documents_are_what_the_json_gives():
    for path, (text, new) in make_tables.regenerate_all().items():
        assert new == text, f"{path.name} is stale: run python benchmarks/make_tables.py"


def test_a_number_edited_by_hand_is_caught():
    text = make_tables.BENCHMARKS_MD.read_text()
    block = next(make_tables.BLOCK.finditer(text))
    body = block["body"]
    digit = re.search(r"\| (\d)", body)
    edited_body = body[:digit.start(1)] + str((int(digit[1]) + 1) % 10) + body[digit.end(1):]
    edited = text[:block.start("body")] + edited_body + text[block.end("body"):]
    assert edited != text
    assert make_tables.regenerate(edited)[0] == text


def test_every_table_is_placed_once_and_reads_files_that_exist():
    keys = [m["key"] for path in make_tables.DOCUMENTS for m in make_tables.BLOCK.finditer(path.read_text())]
    assert sorted(keys) == sorted(make_tables.TABLES)
    missing = [name for name in make_tables.result_files() if not result_path(name).is_file()]
    assert missing == []


def test_results_in_the_tree_fit_the_budget():
    num_bytes = sum(p.stat().st_size for p in RESULTS.rglob("*") if p.is_file())
    assert num_bytes <= RESULTS_BUDGET_BYTES, f"benchmarks/results holds {num_bytes / 1e6:.1f} MB"


def test_files_piped_into_a_reader_that_closes_early_is_no_error():
    """``python benchmarks/make_tables.py --files | head -1``: the listing stops quietly when its reader goes away."""
    script = Path(make_tables.__file__)
    proc = subprocess.Popen([sys.executable, str(script), "--files"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the listing is written
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and err == b"", err
