"""Result JSON is read the same whether the tree keeps it plain or gzipped, and under the name it was written as."""

from __future__ import annotations

import gzip
import json

import pytest

from kvrelay.eval.result_files import read_json, write_json_gz

DATA = {"calls": [{"problem_id": "p0", "ttft_ms": 12.5}], "note": "ünïcode"}


def test_plain_and_gzipped_read_the_same(tmp_path):
    plain, packed = tmp_path / "a.json", tmp_path / "b.json.gz"
    plain.write_text(json.dumps(DATA))
    write_json_gz(packed, DATA)
    assert gzip.decompress(packed.read_bytes())  # really gzipped
    assert read_json(plain) == read_json(packed) == DATA


def test_a_json_name_reads_its_gzipped_file(tmp_path):
    write_json_gz(tmp_path / "run.json.gz", DATA)
    assert read_json(tmp_path / "run.json") == DATA
    assert read_json(str(tmp_path / "run.json")) == DATA


def test_the_plain_file_wins_when_both_exist(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"which": "plain"}))
    write_json_gz(tmp_path / "run.json.gz", {"which": "gzipped"})
    assert read_json(tmp_path / "run.json") == {"which": "plain"}


def test_a_missing_file_is_an_error_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.json"):
        read_json(tmp_path / "nothing.json")
