"""What a process knows of spans published elsewhere: announcements read from the shared tier.

Each announcement (span id, token ids, original start) is queued for ``poll_published`` (the
any-offset index is fed from there), and a span that starts at position 0 also enters an exact-prefix
index (``cache.prefix_index``, the memory tier's), so ``match_prefix`` finds another process's prefix too. Pure Python,
no torch; bounded (oldest announced spans are forgotten first).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from kvrelay.cache.prefix_index import PrefixIndex, PrefixMatch

log = logging.getLogger("kvrelay.tier")


@dataclass(frozen=True)
class PublishedSpan:
    """A span some process put into the shared tier (what an index needs to find it by content)."""

    span_id: str
    namespace: str
    fingerprint: str
    token_ids: tuple[int, ...]
    start_pos: int
    origin: str  # the publishing store's id (``TieredStore.origin``)


def announcement(span_id: str, token_ids: tuple[int, ...], start_pos: int, origin: str) -> bytes:
    return json.dumps({"span_id": span_id, "token_ids": list(token_ids), "start_pos": start_pos,
                       "origin": origin}).encode()


class RemoteSpans:
    """Announced spans: a queue per (namespace, model) and an exact-prefix index of those at position 0."""

    def __init__(self, hashes: Callable[[str, str, tuple[int, ...]], list[bytes]], block_len: int,
                 max_spans: int = 10_000, max_pending: int = 100_000) -> None:
        self._hashes, self.block_len = hashes, block_len  # hashes(fingerprint, namespace, token_ids)
        self.max_spans, self.max_pending = max_spans, max_pending
        self._pending: dict[tuple[str, str], deque[PublishedSpan]] = {}
        self._spans: OrderedDict[tuple[str, str], tuple[tuple[int, ...], list[bytes]]] = OrderedDict()
        self._prefixes = PrefixIndex(block_len)  # hashes are namespace-seeded: span ids suffice
        self._lock = threading.Lock()
        self.num_bad = 0  # announcements skipped as unreadable

    def add(self, namespace: str, fingerprint: str, messages: list[bytes]) -> None:
        with self._lock:
            queue = self._pending.setdefault((namespace, fingerprint), deque(maxlen=self.max_pending))
            for raw in messages:
                try:
                    m = json.loads(raw)
                    span = PublishedSpan(str(m["span_id"]), namespace, fingerprint,
                                         tuple(int(t) for t in m["token_ids"]), int(m["start_pos"]), str(m["origin"]))
                    if span.start_pos < 0:
                        raise ValueError("negative start position")
                except (ValueError, KeyError, TypeError):
                    self.num_bad += 1
                    log.warning("unreadable announcement skipped")
                    continue
                queue.append(span)
                if span.start_pos == 0:
                    self._remember(span)

    def take(self, namespace: str, fingerprint: str) -> list[PublishedSpan]:
        with self._lock:  # an emptied queue is not kept: a namespace per client salt would keep one each
            return list(self._pending.pop((namespace, fingerprint), ()))

    def forget_channel(self, namespace: str, fingerprint: str) -> None:
        """Drop what waits for ``take`` on a channel no longer polled (its reader position was forgotten)."""
        with self._lock:
            self._pending.pop((namespace, fingerprint), None)

    @property
    def num_channels(self) -> int:
        """Channels with announcements waiting for ``take``."""
        return len(self._pending)

    def _remember(self, span: PublishedSpan) -> None:
        key = (span.namespace, span.span_id)
        self._forget(key)
        hashes = self._hashes(span.fingerprint, span.namespace, span.token_ids)
        self._spans[key] = (span.token_ids, hashes)
        self._prefixes.add(span.span_id, hashes)
        while len(self._spans) > self.max_spans:
            self._forget(next(iter(self._spans)))

    def _forget(self, key: tuple[str, str]) -> None:
        entry = self._spans.pop(key, None)
        if entry:
            self._prefixes.remove(key[1], entry[1])

    def forget(self, namespace: str, span_id: str) -> None:
        with self._lock:
            self._forget((namespace, span_id))

    def match(self, fingerprint: str, token_ids: list[int] | tuple[int, ...], namespace: str) -> PrefixMatch | None:
        """The announced span sharing the longest exact prefix with ``token_ids`` (as ``KVStore.match_prefix``)."""
        hashes = self._hashes(fingerprint, namespace, tuple(token_ids))
        with self._lock:
            return self._prefixes.longest(hashes, token_ids, lambda span_id: self._spans[(namespace, span_id)][0])
