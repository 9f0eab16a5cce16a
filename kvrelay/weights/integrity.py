"""Checksums of a converted-model folder, recorded at conversion and verified at every load.

Small files (tokenizer) are hashed in full on every load. The weights file is large, so a load
compares its size and mtime with the record and hashes a sample of blocks (first, last and evenly
spaced ones); a changed size or mtime, or ``full=True``, hashes the whole file. The config lives in
``meta.json`` itself, so its canonical JSON is hashed too: an edited value (``rope_theta``) fails.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

SAMPLE_BLOCK_BYTES = 1 << 16
SAMPLE_BLOCKS = 32  # evenly spaced blocks hashed on the fast path, besides the first and the last
SMALL_FILE_BYTES = 1 << 24  # files up to this size are hashed in full on every load


class IntegrityError(Exception):
    """A converted file does not match its record (internal: the loader turns it into a rebuild)."""


def file_sha256(path: Path, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def sample_sha256(path: Path, size_bytes: int) -> str:
    """Hash of the first and last blocks and ``SAMPLE_BLOCKS`` evenly spaced ones (all of a small file)."""
    digest = hashlib.sha256(str(size_bytes).encode())
    if size_bytes <= SAMPLE_BLOCK_BYTES * (SAMPLE_BLOCKS + 2):
        return hashlib.sha256(digest.digest() + bytes.fromhex(file_sha256(path))).hexdigest()
    last = size_bytes - SAMPLE_BLOCK_BYTES
    offsets = sorted({0, last, *(last * (i + 1) // (SAMPLE_BLOCKS + 1) for i in range(SAMPLE_BLOCKS))})
    with open(path, "rb") as f:
        for offset in offsets:
            f.seek(offset)
            digest.update(f.read(SAMPLE_BLOCK_BYTES))
    return digest.hexdigest()


def config_sha256(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def record_file(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"size_bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "sample_sha256": sample_sha256(path, st.st_size),
            "sha256": file_sha256(path)}


def record_folder(folder: Path, names: list[str], config: dict[str, Any]) -> dict[str, Any]:
    """What ``verify_folder`` checks later: per file size, mtime, sample and full hashes; the config hash."""
    return {"files": {name: record_file(folder / name) for name in names}, "config_sha256": config_sha256(config)}


def verify_folder(folder: Path, meta: dict[str, Any], full: bool = False) -> bool:
    """Raise ``IntegrityError`` naming the first file that differs from ``meta``'s record.

    Returns True when a full hash was needed because a size or mtime changed (the caller may then
    refresh the recorded mtimes, so the next load takes the fast path again)."""
    record = meta.get("integrity")
    if not isinstance(record, dict) or not isinstance(record.get("files"), dict):
        raise IntegrityError("meta.json has no integrity record")
    if config_sha256(meta.get("config")) != record.get("config_sha256"):
        raise IntegrityError("meta.json: the model config differs from the one recorded at conversion")
    refreshed = False
    for name, want in record["files"].items():
        path = folder / name
        if not path.is_file():
            raise IntegrityError(f"{name} is missing")
        st = path.stat()
        if st.st_size != want.get("size_bytes"):
            raise IntegrityError(f"{name}: size {st.st_size} bytes, recorded {want.get('size_bytes')}")
        if full or st.st_size <= SMALL_FILE_BYTES or st.st_mtime_ns != want.get("mtime_ns"):
            refreshed |= st.st_mtime_ns != want.get("mtime_ns")
            if file_sha256(path) != want.get("sha256"):
                raise IntegrityError(f"{name}: sha256 differs from the one recorded at conversion")
        elif sample_sha256(path, st.st_size) != want.get("sample_sha256"):
            raise IntegrityError(f"{name}: sampled blocks differ from the ones recorded at conversion")
    return refreshed
