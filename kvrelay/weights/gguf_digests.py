"""The digest index: which sha256 each GGUF path had at its size and mtime.

A conversion is keyed by its GGUF's content; hashing a few hundred MB on every load would cost more than the
load itself, so each path's digest is remembered in ``gguf-digests.json`` under the cache root. The index is
only a memo: an unreadable or stale entry means the file is hashed again.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from pathlib import Path

from kvrelay.errors import CorruptModelError
from kvrelay.weights.integrity import file_sha256

DIGEST_INDEX = "gguf-digests.json"  # under the cache root: resolved path -> size, mtime_ns, sha256 of a GGUF
DIGEST_INDEX_MAX = 256  # entries kept (the most recently hashed); paths that no longer exist are dropped
_SHA256 = re.compile(r"[0-9a-f]{64}")
GGUF_MAGIC = b"GGUF"


def check_gguf_magic(path: Path) -> None:
    """A CorruptModelError unless ``path`` starts with the GGUF magic: checked before a load hashes the file,
    records its digest or says it converts it (none of which a file that is not a GGUF should get)."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise CorruptModelError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")


def _read_index(root: Path) -> dict[str, dict]:
    """The digest index's entries; an unreadable or malformed index is an empty one (it is only a memo)."""
    try:
        data = json.loads((root / DIGEST_INDEX).read_text())
    except (OSError, ValueError):
        return {}
    entries = data.get("entries") if isinstance(data, dict) else None
    return entries if isinstance(entries, dict) else {}


def indexed_sha256(path: Path, st: os.stat_result, root: Path) -> str | None:
    """The digest the index holds for ``path``, if its entry matches the file's size and mtime."""
    entry = _read_index(root).get(str(path.resolve()))
    if (isinstance(entry, dict) and entry.get("size_bytes") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns
            and isinstance(entry.get("sha256"), str) and _SHA256.fullmatch(entry["sha256"])):
        return entry["sha256"]
    return None


def _remember_sha256(path: Path, st: os.stat_result, digest: str, root: Path) -> None:
    """Add ``path``'s digest to the index: re-read just before, written to a temp file and renamed in, so a
    reader never sees half an index. Two writers at once may lose one entry: that file is hashed again."""
    index = _read_index(root)
    index.pop(str(path.resolve()), None)
    index[str(path.resolve())] = {"size_bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    kept = [(k, v) for k, v in index.items() if os.path.exists(k)][-DIGEST_INDEX_MAX:]
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{DIGEST_INDEX}.")
    except OSError:
        return  # an unwritable cache: the file is hashed again next time (the conversion says why it fails)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"version": 1, "entries": dict(kept)}, f, indent=1)
        os.replace(tmp, root / DIGEST_INDEX)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def gguf_sha256(path: Path, root: Path) -> str:
    """The sha256 of a GGUF file's content: from the index when it knows this path at this size and mtime,
    else hashed (under a second for a few hundred MB) and remembered in ``root``'s index. A file without the GGUF
    magic is a CorruptModelError, before any of that."""
    check_gguf_magic(path)
    st = path.stat()
    digest = indexed_sha256(path, st, root)
    if digest is None:
        digest = file_sha256(path)
        after = path.stat()
        if (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns):  # not rewritten while hashed
            _remember_sha256(path, st, digest, root)
    return digest
