"""Compiled grammars kept per namespace, so an agent that sends the same tools every turn compiles them once.

The grammar library has a cache of its own, shared by every tenant and unbounded: a tenant could grow the server's
memory by a few megabytes with each new schema, and could tell from its own latency whether any other tenant had
compiled a given schema (tools and answer formats name a framework, a product, a customer). So the server turns
that cache off (kvrelay.server.grammar) and keeps this one: entries live under the namespace (API key,
``cache_salt``) that compiled them, a lookup sees its own namespace's only, and all of them together are bounded in
bytes, least recently used first out.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any

MAX_GRAMMAR_CACHE_BYTES = 256 << 20


def grammar_key(plan: Any, response_format: Any) -> str:
    """What a compiled grammar depends on (the tool plan and the response format, their full reprs), as a digest: a
    key's size is then fixed, whatever the tools' descriptions, and the bytes bound holds."""
    return hashlib.sha256(repr((plan, response_format)).encode("utf-8", "surrogatepass")).hexdigest()


class GrammarCache:
    """Thread-safe LRU of (namespace, ``grammar_key``) -> a compiled constraint, bounded by ``max_bytes``."""

    def __init__(self, max_bytes: int = MAX_GRAMMAR_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[tuple[str, str], tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, namespace: str, key: str) -> Any | None:
        with self._lock:
            entry = self._entries.get((namespace, key))
            if entry is None:
                return None
            self._entries.move_to_end((namespace, key))
            return entry[0]

    def put(self, namespace: str, key: str, constraint: Any, num_bytes: int) -> None:
        """Keep ``constraint`` (``num_bytes`` in memory); one over the whole budget is not kept."""
        if num_bytes > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop((namespace, key), None)
            if old is not None:
                self.num_bytes -= old[1]
            while self._entries and self.num_bytes + num_bytes > self.max_bytes:
                _, (_, dropped_bytes) = self._entries.popitem(last=False)
                self.num_bytes -= dropped_bytes
            self._entries[(namespace, key)] = (constraint, num_bytes)
            self.num_bytes += num_bytes
