"""A directory of span files, shared by every process on the machine (or a shared file system).

``<key>.v`` holds the encoded span, ``<key>.m`` its metadata; both are written to a temporary file
in the same directory and renamed into place, so a reader sees a whole file or none, and the value is
renamed before the metadata, so metadata implies a complete value. Announcements are lines
appended to ``<channel>.log`` with O_APPEND (one ``write`` each, so lines never interleave); the
cursor is a byte offset. Files survive the process: a restarted process finds every span again.

A line that is not base64 (a writer killed mid-line, whose remains the next line joins; a hand edit) is
skipped and counted in ``num_bad_records``, and the cursor moves past it: one bad line never stops the
announcements after it. A log shorter than the cursor (replaced or truncated) is read again from its start.
"""

from __future__ import annotations

import base64
import binascii
import os
import tempfile
import time
from pathlib import Path

from kvrelay.errors import ConfigError


class DiskBackend:
    kind = "disk"  # what /health and the metrics call this tier

    def __init__(self, path: str | Path, fsync: bool = False) -> None:
        self.root = Path(path).expanduser()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"disk store directory {str(self.root)!r} cannot be created: {e.strerror}") from None
        if not os.access(self.root, os.W_OK):
            raise ConfigError(f"disk store directory {str(self.root)!r} is not writable")
        self.url = f"disk:{self.root}"
        self.fsync = fsync  # durable across power loss too (slower puts); a process restart needs none
        self.num_bad_records = 0  # announcement lines skipped as unreadable
        self._remove_stale_temporaries()

    def _remove_stale_temporaries(self, min_age_s: float = 600.0) -> None:
        """Temporary files of writers killed mid-write (a live writer renames its file within seconds)."""
        now = time.time()
        for tmp in self.root.glob(".tmp-*"):
            try:
                if now - tmp.stat().st_mtime > min_age_s:
                    tmp.unlink()
            except OSError:  # another process removed or renamed it first
                pass

    def _write_atomic(self, name: str, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.root)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, self.root / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def put(self, key: str, value: bytes, meta: bytes) -> None:
        self._write_atomic(key + ".v", value)
        self._write_atomic(key + ".m", meta)

    def _read(self, name: str) -> bytearray | None:
        try:
            with open(self.root / name, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                buf = bytearray(size)  # read straight into a writable buffer: decoding then copies nothing
                num_read = f.readinto(buf)
        except FileNotFoundError:
            return None
        return buf if num_read == size else buf[:num_read]

    def get_meta(self, key: str) -> bytes | None:
        return self._read(key + ".m")

    def get_value(self, key: str) -> bytes | None:
        return self._read(key + ".v")

    def touch(self, key: str) -> bool:
        # the value is renamed into place before the metadata: metadata there means a whole value, until a delete
        return (self.root / (key + ".m")).exists() and (self.root / (key + ".v")).exists()

    def delete(self, key: str) -> None:
        for suffix in (".m", ".v"):  # metadata first: a reader never sees metadata without a value
            (self.root / (key + suffix)).unlink(missing_ok=True)

    def announce(self, channel: str, message: bytes) -> None:
        line = base64.b64encode(message) + b"\n"
        fd = os.open(self.root / (channel + ".log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def poll(self, channel: str, cursor: str | None) -> tuple[list[bytes], str | None]:
        offset = int(cursor or 0)
        try:
            with open(self.root / (channel + ".log"), "rb") as f:
                if os.fstat(f.fileno()).st_size < offset:  # replaced or truncated: its lines are new ones
                    offset = 0
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return [], cursor
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next poll
        messages = []
        for line in complete.splitlines():
            if not line:
                continue
            try:
                messages.append(base64.b64decode(line, validate=True))
            except (binascii.Error, ValueError):
                self.num_bad_records += 1
        return messages, str(offset + len(complete))

    def ping(self) -> None:
        """Raise unless the directory is there and writable (an unmounted share, a removed directory)."""
        if not self.root.is_dir() or not os.access(self.root, os.W_OK):
            raise OSError(f"{str(self.root)!r} is not a writable directory")

    def close(self) -> None:
        pass
