"""Benchmark data from ../shared/data (or any file of the same format given with --data)."""

from __future__ import annotations

import json
import os
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
                answer = row["answer"].rsplit("####", 1)[1].strip().replace(",", "")
                problems.append(GSM8KProblem(row["question"], answer))
            except (json.JSONDecodeError, KeyError, IndexError) as exc:
                raise KvRelayError(f"{path}:{line_no}: not a GSM8K row with question and "
                                   f"'answer ... #### N' ({exc})") from exc
            if limit is not None and len(problems) >= limit:
                break
    return problems
