"""The CLI end to end, as a user runs it."""

import subprocess
import sys

import pytest


def _kvrelay(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "kvrelay", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_demo_prints_its_table():
    out = _kvrelay("demo", "--num-problems", "1", "--repeats", "1", "--solver-tokens", "24", "--greedy-tokens", "8")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    row = {line.split()[0]: line.split() for line in lines if line.split() and line.split()[0] in ("full", "prefix")}
    assert set(row) == {"full", "prefix"}
    assert row["full"][2] == "1.00x" and float(row["full"][3]) == 0.0
    assert float(row["prefix"][3]) > 0.5  # the checker's prompt is mostly the solver's conversation
    assert float(row["prefix"][4]) == 1.0  # exact reuse: the first token agrees


def test_unknown_model_is_a_clear_error():
    out = _kvrelay("generate", "hi", "--model", "nope")
    assert out.returncode == 2
    assert "kvrelay: error: unknown model 'nope'" in out.stderr and "Traceback" not in out.stderr


def test_bad_flag_value_is_a_clear_error():
    out = _kvrelay("generate", "hi", "--model", "random:tiny", "--top-p", "2")
    assert out.returncode == 2 and "top_p must be in (0, 1]" in out.stderr
