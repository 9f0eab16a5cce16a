"""Answer parsing and the HumanEval executor."""

import pytest

from kvrelay.data.scoring import extract_code, extract_letter, extract_number, gsm8k_correct, run_humaneval


@pytest.mark.parametrize("text, expected", [
    ("so she has 18 eggs. Answer: 18", 18.0),
    ("Answer: $1,234.50 in total", 1234.5),
    ("The answer is -7.", -7.0),
    ("#### 72", 72.0),
    ("first 3, then 4, finally 12", 12.0),
    ("Answer: 5 ... wait, Answer: 6", 6.0),
    ("The answer is **42**", 42.0),
    ("no number here", None),
    ("costs 3.75 dollars", 3.75),
])
def test_gsm8k_number_extraction(text, expected):
    assert extract_number(text) == expected


def test_gsm8k_correct_compares_numbers():
    assert gsm8k_correct("Answer: 1,000", "1000")
    assert gsm8k_correct("Answer: 18.0", "18")
    assert not gsm8k_correct("Answer: 17", "18")
    assert not gsm8k_correct("I don't know", "18")


@pytest.mark.parametrize("text, expected", [
    ("Answer: B", "B"), ("The answer is (c).", "C"), ("I think D) is right", "D"),
    ("A. because ...", "A"), ("Between them, B", "B"), ("none of those", None),
])
def test_mmlu_letter_extraction(text, expected):
    assert extract_letter(text) == expected


PROMPT = 'def add(a, b):\n    """Add two numbers."""\n'
TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"


def test_humaneval_passing_failing_crashing_looping():
    assert run_humaneval(PROMPT, "```python\ndef add(a, b):\n    return a + b\n```", TEST, "add").status == "passed"
    assert run_humaneval(PROMPT, "    return a + b\n", TEST, "add").passed  # a bare completion of the body
    assert run_humaneval(PROMPT, "    return a - b\n", TEST, "add").status == "failed"
    assert run_humaneval(PROMPT, "    raise ValueError('x')\n", TEST, "add").status == "error"
    looping = run_humaneval(PROMPT, "    while True:\n        pass\n", TEST, "add", timeout_s=2)
    assert looping.status == "timeout"


def test_humaneval_sandbox_blocks_network_and_subprocesses():
    net = "    import socket\n    socket.create_connection(('127.0.0.1', 9))\n    return a + b\n"
    assert run_humaneval(PROMPT, net, TEST, "add").status == "error"
    sub = "    import subprocess\n    subprocess.run(['true'])\n    return a + b\n"
    assert run_humaneval(PROMPT, sub, TEST, "add").status == "error"


def test_extract_code():
    assert extract_code("Here:\n```python\nx = 1\n```\nbye") == "x = 1\n"
    assert extract_code("x = 2") == "x = 2"
