"""BENCHMARKS.md's and docs/methods.md's tables are what ``benchmarks/make_tables.py`` makes from the committed JSON,
and the results kept in the tree are the ones those tables read, within the size budget."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import make_tables
import pytest
import table_render as render
from table_render import RESULTS, load, result_path

from kvrelay.cli import branch_bench_config, build_parser
from kvrelay.errors import ConfigError
from kvrelay.eval.configs import BenchConfig, BranchBenchConfig
from kvrelay.eval.result_files import read_json
from kvrelay.flags import dataclass_from_args

RESULTS_BUDGET_BYTES = 5 * 10**6
# a whole command as a document gives it to copy: its output file named
BENCH_COMMAND = re.compile(r"`((?:\w+=\S+ )*kvrelay bench [^`]*--json [^`]*)`")


def documented_bench_commands() -> list[str]:
    return [m[1] for path in make_tables.DOCUMENTS for m in BENCH_COMMAND.finditer(path.read_text())]


def bench_config(command: str) -> BenchConfig | BranchBenchConfig:
    """What ``kvrelay bench`` makes of ``command`` before it loads a model (its flags and their config)."""
    argv = shlex.split(command)
    argv = argv[argv.index("kvrelay") + 1:]
    args = build_parser().parse_args(argv)
    if args.workload == "gsm8k-branches":
        return branch_bench_config(args)  # as the command line makes it: defaults for the flags not given
    return dataclass_from_args(BenchConfig, args)


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


def test_every_documented_bench_command_is_accepted():
    """A researcher copies a caption's command: it must get past the bench's checks, not stop with an error."""
    commands = documented_bench_commands()
    assert len(commands) >= 15
    for command in commands:
        bench_config(command)  # a flag, method or combination the bench refuses raises here, naming it


def test_a_refused_command_is_caught():
    command = documented_bench_commands()[0]
    with pytest.raises(ConfigError, match="nothing to warm"):
        bench_config(command.replace(" --json", " --warm-problems 4 --json"))


# relay rows measured with a selector that no longer ships: the prose before each table gives the shipped default's
# change on a few calls, from behaviour_snapshot.py's files (table key -> the files' suffix)
SNAPSHOT_NOTES = {"smollm2-humaneval": "smollm2-humaneval", "gemma3-gsm8k": "gemma3-gsm8k"}


def snapshot_numbers(name: str) -> dict:
    """Per-call means of relay on a behaviour snapshot's calls, as the prose rounds them."""
    d = read_json(RESULTS / name)
    calls = [c for c in d["calls"] if c["method"] == "relay"]

    def mean(key: str) -> float:
        return sum(float(c[key]) for c in calls) / len(calls)

    return {"calls": len(calls), "reuse": f"{mean('reuse_rate'):.3f}", "kl": f"{mean('kl_first_token'):.4f}",
            "greedy": f"{mean('greedy_match'):.2f}", "config": d["config"]}


@pytest.mark.parametrize("key", sorted(SNAPSHOT_NOTES))
def test_the_shipped_relay_notes_are_what_their_snapshots_give(key):
    text = make_tables.BENCHMARKS_MD.read_text()
    end = text.index(f"<!-- table: {key} -->")
    note = " ".join(text[text.rindex("###", 0, end):end].split())
    stem = f"behaviour-no-workload-selectors-{{}}-{SNAPSHOT_NOTES[key]}.json"
    before, after = snapshot_numbers(stem.format("before")), snapshot_numbers(stem.format("after"))
    assert stem.format("{before,after}") in note
    assert f"{after['calls']} downstream calls" in note
    assert f"reuse {after['reuse']} instead of {before['reuse']}" in note
    assert f"KL {after['kl']} instead of {before['kl']}" in note
    greedy = f"{after['greedy']} both" if after["greedy"] == before["greedy"] else \
        f"{after['greedy']} instead of {before['greedy']}"
    assert f"greedy@{after['config']['greedy_tokens']} {greedy}" in note
    for flag in ("models", "workloads"):  # the command that wrote the files, as far as it differs from the defaults
        assert f"--{flag} {','.join(after['config'][flag])}" in note


def test_every_method_row_says_which_command_measures_it():
    """A row whose method no shown command runs (a file merged from earlier runs) says so and how to measure it."""
    for key, table in make_tables.TABLES.items():
        if table.rows is None:
            continue
        text = table.make()
        commands = " ".join(re.findall(r"--methods (\S+)", text))
        earlier = re.search(r"((?:`[^`]+`, )*`[^`]+`) came from earlier runs", text)
        named = set(re.findall(r"`([^`]+)`", earlier[1])) if earlier else set()
        for label in table.rows.values():
            assert label in re.split(r"[ ,]", commands) or label in named, f"{key}: row {label!r} has no command"


def test_the_engine_command_is_the_one_run_all_and_make_bench_run():
    """The engine table's command, run_all.sh's and `make bench`'s write the same file with the same flags, so
    each writes every row the table renders (the 4-bit decode row needs --int4-decode)."""
    root = make_tables.ROOT
    documented = re.search(r"Command: `python (benchmarks/bench_engine\.py [^`]*)`",
                           make_tables.BENCHMARKS_MD.read_text())[1]
    run_all = re.search(r"\$PY (benchmarks/bench_engine\.py [^;]*);", (root / "benchmarks/run_all.sh").read_text())[1]
    make_bench = re.search(r"\$\(PY\) (benchmarks/bench_engine\.py .*)", (root / "Makefile").read_text())[1]
    assert run_all.replace("$R/", "benchmarks/results/") == documented
    assert make_bench.strip() == documented


def test_the_engine_table_shows_what_its_file_holds():
    d = load("engine_cpu.json")
    d["decode"] = {k: v for k, v in d["decode"].items() if "int4" not in k}
    text = render.render_engine(d, "e.json")
    assert "4-bit" not in text and "--int4-decode" not in text
    d["config"] = {"model": "smollm2-135m", "prompt_tokens": 256, "new_tokens": 64, "repeats": 3,
                   "int4_decode": False}
    assert "`python benchmarks/bench_engine.py --prompt-tokens 256 --new-tokens 64 --repeats 3 --json " \
           "benchmarks/results/e.json`" in render.render_engine(d, "e.json")


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
