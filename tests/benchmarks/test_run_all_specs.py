"""benchmarks/run_all.sh names only methods and settings the package has, and warms only methods that keep state:
a rerun that stops at its first command on a flag the bench refuses reproduces nothing."""

import re
from pathlib import Path

from kvrelay.reuse import get_method, split_method_specs

RUN_ALL = Path(__file__).resolve().parents[2] / "benchmarks" / "run_all.sh"
METHODS_FLAG = re.compile(r"--methods\s+(\"[^\"]*\"|'[^']*'|\S+)")


def method_lists(script: str) -> list[str]:
    return [m.group(1).strip("\"'") for m in METHODS_FLAG.finditer(script)]


def test_the_script_names_method_lists():
    assert len(method_lists(RUN_ALL.read_text())) >= 5


def test_every_method_spec_in_run_all_parses():
    lists = method_lists(RUN_ALL.read_text())
    assert not [text for text in lists if "$" in text], "a --methods list built from shell variables"
    for text in lists:
        for spec in split_method_specs(text):
            get_method(spec)  # an unknown method or setting raises ConfigError naming it


def bench_commands(script: str) -> list[str]:
    """The script's bench command lines, continuation lines joined."""
    joined = script.replace("\\\n", " ")
    return [line for line in joined.splitlines() if "$BENCH " in line or " bench " in line]


def test_every_warm_up_in_run_all_has_a_stateful_method_to_warm():
    commands = bench_commands(RUN_ALL.read_text())
    assert any("--warm-problems" in c for c in commands)  # kvcomm's tables are measured warm
    for command in commands:
        if "--warm-problems" in command:
            specs = split_method_specs(method_lists(command)[0])
            assert any(get_method(spec).stateful for spec in specs), f"nothing to warm: {command.strip()}"
