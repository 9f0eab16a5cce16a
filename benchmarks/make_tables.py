"""BENCHMARKS.md's tables, regenerated from the result JSON each one names (no number typed by hand).

BENCHMARKS.md and docs/methods.md hold hand-written text and, between ``<!-- table: KEY -->`` and
``<!-- /table -->``, tables this script writes. ``TABLES`` below says which JSON files in ``benchmarks/results/`` each
table is made from; those files are the only results the tree keeps (``--files`` lists them).

    python benchmarks/make_tables.py            # rewrite the documents' tables in place
    python benchmarks/make_tables.py --check    # exit 1 if a document differs from what the JSON gives
    python benchmarks/make_tables.py --files    # the JSON files the tables read
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import table_render as render

from kvrelay.closed_pipe import run_main

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"
DOCUMENTS = (BENCHMARKS_MD, ROOT / "docs" / "methods.md")
BLOCK = re.compile(r"(<!-- table: (?P<key>[\w-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)

BASELINES = {"full": "full", "prefix": "prefix", "naive": "naive", "cacheblend": "cacheblend", "epic": "epic"}
# Gemma 3's gsm8k-chain3 rows ran relay with a selector calibrated on that workload's agents, spelled out in settings
# that are now internal to the profile's policy; plain ``relay`` no longer runs it (BENCHMARKS.md gives the change)
GEMMA_GSM8K_ENTRY = "relay[l_start=3,l_det=3,l_end=11,l_pre=16,l_suf=0,top_r=0.4,prune=0.25,drift=0.5]"


@dataclass(frozen=True)
class Table:
    """One generated table: the JSON files it reads and how it renders them."""

    files: tuple[str, ...]
    make: Callable[[], str]
    rows: dict[str, str] | None = None  # a method table's rows: method as the JSON names it -> label


def _bench(files: tuple[str, ...], rows: dict[str, str], specs_now: dict[str, str] | None = None) -> Table:
    return Table(files, lambda: render.bench_table(files, rows, specs_now), rows)


def _one(name: str, fn: Callable[[str], str]) -> Table:
    return Table((name,), lambda: fn(name))


COPY_AGENTS = tuple(f"copy-agents-{n}.json" for n in (2, 3, 4, 5))
KVCOMM = ("kvcomm-gsm8k-fc3-warm.json", "kvcomm-mmlu-fc3-warm.json", "kvcomm-humaneval-fc3-warm.json")
RKSC = ("rksc-gsm8k-branches-lane0.json", "rksc-gsm8k-branches-lane1.json")

TABLES: dict[str, Table] = {
    "smollm2-gsm8k": _bench(
        ("smollm2-gsm8k-chain3-anchors-lane0.json", "smollm2-gsm8k-chain3-anchors-lane25.json"),
        {"full": "full", "prefix": "prefix", "naive": "naive", "relay": "relay"}),
    "smollm2-gsm8k-epic": _bench(
        ("smollm2-gsm8k-chain3-lane300.json", "smollm2-gsm8k-chain3-lane325.json"),
        {"full": "full", "prefix": "prefix", "epic": "epic", "relay": "relay"}),
    "smollm2-humaneval": _bench(
        ("smollm2-humaneval-adr-lane50.json", "smollm2-humaneval-adr-lane75.json"),
        {"full": "full", "prefix": "prefix", "naive": "naive", "epic": "epic", "relay": "relay"}),
    "gemma3-gsm8k": _bench(
        ("gemma3-gsm8k-chain3-combined.json",),
        {**BASELINES, GEMMA_GSM8K_ENTRY: "relay"}, {GEMMA_GSM8K_ENTRY: "relay"}),
    "gemma3-humaneval": _bench(
        ("gemma3-humaneval-adr-lane0.json", "gemma3-humaneval-adr-lane25.json"),
        {"full": "full", "prefix": "prefix", "naive": "naive", "epic": "epic", "relay": "relay"}),
    "copy-agents": Table(COPY_AGENTS, lambda: render.copy_agents_table(COPY_AGENTS,
                                                                      ("prefix", "naive", "cacheblend", "epic"))),
    "kvcomm": Table(KVCOMM, lambda: render.kvcomm_table(KVCOMM)),
    "rksc": Table(RKSC, lambda: render.rksc_table(RKSC)),
    "engine": _one("engine_cpu.json", render.engine_table),
    "serve-chain": Table(("serve-chain.json", "serve-chain-inprocess.json"),
                         lambda: render.serve_chain_table("serve-chain.json", "serve-chain-inprocess.json")),
    "serve-load": _one("serve-load.json", render.serve_load_table),
    "serve-index": _one("serve-index.json", render.serve_index_table),
    "tier-fetch": _one("tier_fetch.json", render.tier_fetch_table),
    "llamacpp": _one("llamacpp-side-by-side.json", render.llamacpp_table),
}


# docs/methods.md's overview: the shipped methods' rows of the per-workload tables above
SUMMARY_ROWS = {
    "smollm2-gsm8k": ("naive", "relay"), "smollm2-gsm8k-epic": ("epic", "relay"),
    "smollm2-humaneval": ("naive", "epic", "relay"),
    "gemma3-gsm8k": ("naive", "cacheblend", "epic", GEMMA_GSM8K_ENTRY),
    "gemma3-humaneval": ("naive", "epic", "relay")}
SUMMARY = tuple((TABLES[key].files, {m: TABLES[key].rows[m] for m in methods}) for key, methods in SUMMARY_ROWS.items())
TABLES["methods-summary"] = Table(tuple(f for files, _ in SUMMARY for f in files),
                                  lambda: render.summary_table(SUMMARY))


def result_files() -> list[str]:
    return sorted({name for table in TABLES.values() for name in table.files})


def regenerate(text: str) -> tuple[str, set[str]]:
    """``text`` with every table block rewritten from its JSON, and the keys of the blocks it holds."""
    seen: set[str] = set()

    def fill(m: re.Match) -> str:
        key = m["key"]
        if key not in TABLES:
            raise SystemExit(f"a document names table {key!r}, which make_tables.py does not define")
        seen.add(key)
        return f"{m[1]}{TABLES[key].make()}\n{m[4]}"

    return BLOCK.sub(fill, text), seen


def regenerate_all() -> dict[Path, tuple[str, str]]:
    """Per document: (its text now, its text regenerated); every table must be placed in some document."""
    out, placed = {}, set()
    for path in DOCUMENTS:
        text = path.read_text()
        new, seen = regenerate(text)
        out[path], placed = (text, new), placed | seen
    if missing := sorted(set(TABLES) - placed):
        raise SystemExit(f"tables defined but placed in no document: {', '.join(missing)}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 if a document is not what the JSON gives")
    mode.add_argument("--files", action="store_true", help="print the JSON files the tables read")
    args = parser.parse_args()
    if args.files:
        print("\n".join(result_files()))
        return
    stale = False
    for path, (text, new) in regenerate_all().items():
        if new == text:
            continue
        if args.check:
            stale = True
            sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), new.splitlines(True),
                                                       path.name, "generated"))
        else:
            path.write_text(new)
    sys.exit(1 if stale else 0)


if __name__ == "__main__":
    sys.exit(run_main(main))  # a reader that goes away (| head) ends it quietly
