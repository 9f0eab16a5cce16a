"""`kvrelay run --store disk:PATH`: a second process reuses what the first published to the tier."""

import re
import subprocess
import sys
from pathlib import Path

PIPELINE = """inputs: [question]
agents:
  - name: solver
    system: "You are a careful solver who always explains each step of the work in detail."
    user: "Question: {question}"
    max_new_tokens: 8
  - name: critic
    system: "You check answers."
    user: "Question: {question}\\nAnswer: {solver}\\nIs it right?"
    max_new_tokens: 8
"""


def _run(tmp_path: Path, store: str) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-m", "kvrelay", "run", str(tmp_path / "p.yaml"), "--method", "prefix",
                           "--model", "random:tiny", "--store", store, "--input", "question=What is 17 times 3?"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return {m[1]: float(m[2]) for m in re.finditer(r"=== (\w+) \[.*?reuse ([0-9.]+)", proc.stdout)}


def test_a_second_process_finds_the_first_ones_spans_on_disk(tmp_path):
    (tmp_path / "p.yaml").write_text(PIPELINE)
    first = _run(tmp_path, f"disk:{tmp_path / 'tier'}")
    assert first == {"solver": 0.0, "critic": 0.0}  # nothing stored yet; the critic's prompt starts differently
    second = _run(tmp_path, f"disk:{tmp_path / 'tier'}")
    assert second["solver"] > 0.9 and second["critic"] > 0.9  # each prompt's whole prefix, from the tier
    alone = _run(tmp_path, "memory")  # the same run without the tier reuses nothing
    assert alone == {"solver": 0.0, "critic": 0.0}
