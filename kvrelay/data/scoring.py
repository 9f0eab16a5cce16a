"""Task scores: GSM8K final numbers, MMLU letters, HumanEval pass@1 in a sandboxed subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

_NUMBER = r"-?\$?\s?\d[\d,]*(?:\.\d+)?"


def _to_float(text: str) -> float | None:
    cleaned = text.replace(",", "").replace("$", "").replace(" ", "")
    try:
        return float(cleaned)
    except ValueError:
        return None


def extract_number(text: str) -> float | None:
    """The model's final number: after the last 'Answer:'/'####'/'answer is', else the last number."""
    for pattern in (rf"answer\s*(?:is|:)\s*\**\s*({_NUMBER})", rf"####\s*({_NUMBER})"):
        hits = re.findall(pattern, text, flags=re.IGNORECASE)
        if hits:
            return _to_float(hits[-1])
    hits = re.findall(_NUMBER, text)
    return _to_float(hits[-1]) if hits else None


def gsm8k_correct(text: str, answer: str) -> bool:
    got, want = extract_number(text), _to_float(answer)
    return got is not None and want is not None and abs(got - want) < 1e-6 * max(1.0, abs(want))


def extract_letter(text: str) -> str | None:
    """A/B/C/D: after 'Answer:' / 'answer is', else '(X)' / 'X)' / 'X.' at a word start, else a lone letter."""
    for pattern in (r"answer\s*(?:is|:)\s*\(?\**([ABCD])\b", r"(?:^|\s)\(?([ABCD])[).:](?:\s|$)",
                    r"\b([ABCD])\b"):
        hit = re.search(pattern, text, flags=re.IGNORECASE if "answer" in pattern else 0)
        if hit:
            return hit.group(1).upper()
    return None


def extract_code(text: str) -> str:
    """The first fenced code block of a reply, or the reply itself."""
    fence = re.search(r"```(?:python|py)?\s*\n(.*?)(?:```|$)", text, flags=re.DOTALL)
    return fence.group(1) if fence else text


@dataclass(frozen=True)
class ExecResult:
    passed: bool
    status: str  # passed | failed | timeout | error


# Run before the candidate: no network, no subprocesses, bounded memory. A hostile program could
# still undo this (it is Python); the harness runs model output from our own benchmarks only.
_SANDBOX = """\
import resource, socket, subprocess, os
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
def _blocked(*a, **k):
    raise OSError("blocked by the kvrelay HumanEval sandbox")
socket.socket = _blocked
socket.create_connection = _blocked
subprocess.Popen = _blocked
os.system = _blocked
"""


def run_humaneval(prompt: str, completion: str, test: str, entry_point: str, timeout_s: float = 10.0
                  ) -> ExecResult:
    """pass@1 of one candidate: the full function if the code defines it, else prompt + completion."""
    code = extract_code(completion)
    body = code if re.search(rf"def\s+{re.escape(entry_point)}\s*\(", code) else prompt + code
    header = "\n".join(line for line in prompt.splitlines() if line.startswith(("import ", "from ")))
    program = f"{_SANDBOX}\n{header}\n{body}\n\n{test}\n\ncheck({entry_point})\n"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "candidate.py")
        with open(path, "w") as f:
            f.write(program)
        try:
            proc = subprocess.run([sys.executable, "-I", path], cwd=tmp, capture_output=True, timeout=timeout_s,
                                  env={"PATH": os.environ.get("PATH", ""), "PYTHONHASHSEED": "0"})
        except subprocess.TimeoutExpired:
            return ExecResult(False, "timeout")
    if proc.returncode == 0:
        return ExecResult(True, "passed")
    failed = b"AssertionError" in proc.stderr
    return ExecResult(False, "failed" if failed else "error")
