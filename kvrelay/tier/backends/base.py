"""The narrow interface a shared tier implements, the key scheme and URL redaction."""

from __future__ import annotations

import hashlib
import re
from typing import Protocol

from kvrelay.errors import KvRelayError

KEY_VERSION = "v1"


def _h(text: str, num_hex: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:num_hex]


def span_key(namespace: str, fingerprint: str, span_id: str) -> str:
    """Key of a span: namespace + model fingerprint + span hash, each hashed (no tenant names in keys;
    safe as a file name)."""
    return f"{KEY_VERSION}-{_h(namespace, 16)}-{_h(fingerprint, 16)}-{_h(span_id, 32)}"


def record_key(kind: str, namespace: str, record_id: str) -> str:
    """Key of a small record of the server (``kind``: what it is, e.g. ``resp`` for a stored response) in
    ``namespace``: hashed like a span's key, never a model's (a record is the same for every model)."""
    return f"{KEY_VERSION}-{_h(namespace, 16)}-{kind}-{_h(record_id, 32)}"


def channel_key(namespace: str, fingerprint: str) -> str:
    """Where spans published for one namespace and model are announced."""
    return f"{KEY_VERSION}-{_h(namespace, 16)}-{_h(fingerprint, 16)}-published"


_CREDENTIALS = re.compile(r"^(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<userinfo>[^@/]*@)")


def redact(url: str | None) -> str:
    """``url`` with any user name and password replaced by ``***`` (for every message and log line)."""
    if url is None:
        return "memory"
    out = _CREDENTIALS.sub(lambda m: m.group("scheme") + "***@", url)
    return re.sub(r"(?i)([?&](?:password|pass|pwd|token)=)[^&]*", r"\1***", out)


class TierRefusedError(KvRelayError):
    """The tier answered but refused one operation (out of memory, a value too large): it is not down."""


class TierBackend(Protocol):
    """Bytes under keys, shared by every process that opens the same URL.

    Every method may raise (OSError, a client's error): the tiered store turns that into a miss,
    logs it once and skips the tier until ``ping`` answers again; a backend never has to be defensive itself.
    ``TierRefusedError`` says the tier is up but refused this one operation: a warning, the tier stays up.
    """

    url: str  # redacted
    kind: str  # "redis", "disk": what /health and the metrics call this tier
    # records the backend skipped as unreadable (an announcement that does not decode): counted, never a failure of
    # the tier (the tiered store adds them to its ``bad_records``)
    num_bad_records: int

    def put(self, key: str, value: bytes, meta: bytes) -> None:
        """Store ``value`` and its small ``meta`` so that a reader sees both or neither."""

    def get_meta(self, key: str) -> bytes | None: ...

    def get_value(self, key: str) -> bytes | None: ...

    def delete(self, key: str) -> None: ...

    def touch(self, key: str) -> bool:
        """Whether ``key``'s value and metadata are both there (all of it: a reader would get it), marking them used
        where the tier evicts least recent first."""
        ...

    def announce(self, channel: str, message: bytes) -> None:
        """Append ``message`` to ``channel``'s log (readers poll it with a cursor)."""

    def poll(self, channel: str, cursor: str | None) -> tuple[list[bytes], str | None]:
        """Messages of ``channel`` after ``cursor`` (None: from the start) and the new cursor."""
        ...

    def ping(self) -> None:
        """Raise unless the tier answers now: a cheap call, the prober's while the tier is down."""

    def close(self) -> None: ...
