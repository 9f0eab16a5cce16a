"""Reading and writing result JSON, plain or gzipped: the results kept in the tree have a size budget, so large
ones are stored as ``.json.gz``; a reader takes either (the gzip magic tells them apart)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

GZIP_MAGIC = b"\x1f\x8b"


def read_json(path: str | Path) -> Any:
    """A JSON file, gzipped or plain; a path ending ``.json`` that is absent is read as ``.json.gz`` if that exists."""
    path = Path(path)
    if not path.is_file() and path.with_name(path.name + ".gz").is_file():
        path = path.with_name(path.name + ".gz")
    raw = path.read_bytes()
    return json.loads(gzip.decompress(raw) if raw[:2] == GZIP_MAGIC else raw)


def write_json_gz(path: str | Path, data: Any) -> None:
    Path(path).write_bytes(gzip.compress(json.dumps(data).encode()))
