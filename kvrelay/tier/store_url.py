"""A ``--store`` URL, read and checked without opening anything: ``kvrelay serve`` refuses a bad one before the model
loads (it was refused by ``open_store`` once the model had loaded, seconds and a gigabyte later)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from kvrelay.errors import ConfigError
from kvrelay.tier.backends.base import redact

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


@dataclass(frozen=True)
class StoreUrl:
    kind: str  # "memory", "disk" or "redis"
    location: str = ""  # the disk tier's directory, or the Redis URL as given (credentials included: never print it)


def parse_store_url(url: str | None) -> StoreUrl:
    """``url`` read as ``open_store`` reads it; ConfigError (credentials redacted) for one it would refuse."""
    if url is None or url.strip() in ("", "memory"):
        return StoreUrl("memory")
    url = url.strip()
    if url.startswith("disk:"):
        path = url[len("disk:"):]
        if not path:
            raise ConfigError("store URL 'disk:' needs a directory: disk:PATH")
        _check_directory(Path(path).expanduser())
        return StoreUrl("disk", path)
    if url.startswith(REDIS_SCHEMES):
        from redis.connection import parse_url

        try:
            parse_url(url)
        except ValueError as e:
            raise ConfigError(f"bad Redis URL {redact(url)!r}: {redact(str(e))}") from None
        _check_redis_db(url)
        return StoreUrl("redis", url)
    raise ConfigError(f"unknown store {redact(url)!r}: expected memory, disk:PATH or redis://host:port/db")


def _check_redis_db(url: str) -> None:
    """ConfigError for a database path that is no number: redis-py reads ``/abc`` as database 0 and ``/1/2`` as 12,
    so replicas meant to keep apart would share (or miss) each other's keys."""
    if url.startswith("unix://"):
        return  # the path is the socket's; the database is the ``db`` query parameter, which parse_url checks
    db = urlsplit(url).path.removeprefix("/")
    if db and not (db.isascii() and db.isdigit()):
        raise ConfigError(f"bad Redis URL {redact(url)!r}: the database after the address must be a number "
                          f"(redis://host:port/0), got {db!r}")


def _check_directory(path: Path) -> None:
    """ConfigError unless ``path`` is a writable directory, or could be made in the nearest one that exists."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"disk store directory {str(path)!r} cannot be created: {str(existing)!r} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"disk store directory {str(path)!r} is not writable")
