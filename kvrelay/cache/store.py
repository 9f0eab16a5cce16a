"""The span store's bookkeeping: byte budget, pins, LRU eviction, exact prefix lookup.

Pure Python, no torch: a span is any object with ``nbytes``, ``token_ids``, ``start_pos`` and
``fingerprint`` (``cache.kv.StoredSpan`` in practice), so this file is tested on toy objects.

Prefix lookup hashes token blocks in a chain, ``h_i = sha256(h_{i-1} || block_i)`` seeded with
the model fingerprint, so equal hashes mean equal prefixes of the same model (never Python's
``hash``: it is salted per process and 64-bit).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvrelay.errors import KvRelayError, StoreFullError


class SpanLike(Protocol):
    nbytes: int
    token_ids: tuple[int, ...]
    start_pos: int
    fingerprint: str


@dataclass(frozen=True)
class PrefixMatch:
    span_id: str
    num_tokens: int  # exact common prefix length of the query and the span's token ids


@dataclass
class _Record:
    span: Any
    nbytes: int
    pins: int = 0
    block_hashes: list[bytes] = field(default_factory=list)


def block_hashes(fingerprint: str, token_ids: tuple[int, ...] | list[int], block_len: int) -> list[bytes]:
    """Chained sha256 of each full block of ``token_ids``."""
    out: list[bytes] = []
    prev = hashlib.sha256(fingerprint.encode()).digest()
    for start in range(0, len(token_ids) - block_len + 1, block_len):
        prev = hashlib.sha256(prev + array("q", token_ids[start : start + block_len]).tobytes()).digest()
        out.append(prev)
    return out


class KVStore:
    """Spans by id under a byte budget. Pinned spans are never evicted; others go least recent first."""

    def __init__(self, budget_bytes: int, block_len: int = 16) -> None:
        if budget_bytes <= 0:
            raise KvRelayError(f"store budget must be positive, got {budget_bytes} bytes")
        if block_len <= 0:
            raise KvRelayError(f"store block_len must be positive, got {block_len}")
        self.budget_bytes = int(budget_bytes)
        self.block_len = int(block_len)
        self.used_bytes = 0
        self.peak_bytes = 0
        self.evicted: list[str] = []  # ids in eviction order (for stats and tests)
        self._records: OrderedDict[str, _Record] = OrderedDict()  # oldest use first
        self._prefix_index: dict[bytes, OrderedDict[str, None]] = {}  # block hash -> span ids

    # ------------------------------------------------------------------ basic access
    def __contains__(self, span_id: str) -> bool:
        return span_id in self._records

    def __len__(self) -> int:
        return len(self._records)

    def ids(self) -> list[str]:
        """Span ids, least recently used first."""
        return list(self._records)

    def get(self, span_id: str) -> Any:
        """The span, marked as just used."""
        rec = self._records.get(span_id)
        if rec is None:
            raise KeyError(f"span {span_id!r} is not in the store (never put, or evicted)")
        self._records.move_to_end(span_id)
        return rec.span

    def put(self, span_id: str, span: SpanLike, pin: bool = False) -> list[str]:
        """Store ``span`` (replacing one of the same id); evict LRU unpinned spans to fit.

        Returns the ids evicted. Raises StoreFullError, evicting nothing, when even evicting every
        unpinned span would not make room.
        """
        nbytes = int(span.nbytes)
        old = self._records.get(span_id)
        pins = old.pins if old else 0
        freed_by_replace = old.nbytes if old else 0
        evictable = sum(r.nbytes for sid, r in self._records.items() if r.pins == 0 and sid != span_id)
        free = self.budget_bytes - (self.used_bytes - freed_by_replace)
        if nbytes > free + evictable:
            raise StoreFullError(
                f"span {span_id!r} needs {nbytes} bytes; the store has {free} free of {self.budget_bytes} "
                f"and only {evictable} bytes of unpinned spans to evict"
            )
        if old is not None:
            self._drop(span_id)
        evicted = []
        while self.used_bytes + nbytes > self.budget_bytes:
            victim = next(sid for sid, r in self._records.items() if r.pins == 0)
            self._drop(victim)
            self.evicted.append(victim)
            evicted.append(victim)
        rec = _Record(span, nbytes, pins + (1 if pin else 0))
        if span.start_pos == 0:  # only a span that starts at position 0 can be an exact prefix
            rec.block_hashes = block_hashes(span.fingerprint, span.token_ids, self.block_len)
            for h in rec.block_hashes:
                self._prefix_index.setdefault(h, OrderedDict())[span_id] = None
        self._records[span_id] = rec
        self.used_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        return evicted

    def remove(self, span_id: str) -> None:
        if span_id not in self._records:
            raise KeyError(f"span {span_id!r} is not in the store")
        self._drop(span_id)

    def _drop(self, span_id: str) -> None:
        rec = self._records.pop(span_id)
        self.used_bytes -= rec.nbytes
        for h in rec.block_hashes:
            ids = self._prefix_index[h]
            del ids[span_id]
            if not ids:
                del self._prefix_index[h]

    # ------------------------------------------------------------------ pins
    def pin(self, span_id: str) -> None:
        if span_id not in self._records:
            raise KeyError(f"cannot pin {span_id!r}: not in the store")
        self._records[span_id].pins += 1

    def unpin(self, span_id: str) -> None:
        rec = self._records.get(span_id)
        if rec is None or rec.pins == 0:
            raise KvRelayError(f"cannot unpin {span_id!r}: it is not pinned")
        rec.pins -= 1

    def is_pinned(self, span_id: str) -> bool:
        return self._records[span_id].pins > 0

    # ------------------------------------------------------------------ lookup
    def match_prefix(self, fingerprint: str, token_ids: list[int] | tuple[int, ...]) -> PrefixMatch | None:
        """The stored span sharing the longest exact prefix with ``token_ids`` (same model).

        Blocks are matched by chained hash, then the match is extended token by token into the
        next partial block, so the length is exact, not rounded to a block.
        """
        candidates: OrderedDict[str, None] | None = None
        num_blocks = 0
        for h in block_hashes(fingerprint, token_ids, self.block_len):
            ids = self._prefix_index.get(h)
            if not ids:
                break
            candidates, num_blocks = ids, num_blocks + 1
        if candidates is None:
            return None
        best: PrefixMatch | None = None
        for span_id in reversed(candidates):  # most recently stored first among equals
            span = self._records[span_id].span
            n = num_blocks * self.block_len
            limit = min(len(token_ids), len(span.token_ids))
            while n < limit and span.token_ids[n] == token_ids[n]:
                n += 1
            if best is None or n > best.num_tokens:
                best = PrefixMatch(span_id, n)
        return best
