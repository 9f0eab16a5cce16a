"""Compiled grammars kept per namespace, so an agent that sends the same tools every turn compiles them once.

The grammar library has a cache of its own, shared by every tenant and unbounded: a tenant could grow the server's
memory by a few megabytes with each new schema, and could tell from its own latency whether any other tenant had
compiled a given schema (tools and answer formats name a framework, a product, a customer). So the server turns
that cache off (kvrelay.server.grammar) and keeps this one: entries live under the namespace (API key,
``cache_salt``) that compiled them, a lookup sees its own namespace's only, and all of them together are bounded in
bytes; room is made from the API key holding the most (``FairLru``), least recently used first within it, so one
tenant's stream of new schemas does not make another recompile its tools.
"""

from __future__ import annotations

import hashlib
from typing import Any

from kvrelay.server.fair_lru import FairLru

MAX_GRAMMAR_CACHE_BYTES = 256 << 20


def grammar_key(plan: Any, response_format: Any) -> str:
    """What a compiled grammar depends on (the tool plan and the response format, their full reprs), as a digest: a
    key's size is then fixed, whatever the tools' descriptions, and the bytes bound holds."""
    return hashlib.sha256(repr((plan, response_format)).encode("utf-8", "surrogatepass")).hexdigest()


class GrammarCache:
    """Thread-safe bounded cache of (namespace, ``grammar_key``) -> a compiled constraint (``FairLru``)."""

    def __init__(self, max_bytes: int = MAX_GRAMMAR_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._lru = FairLru(max_bytes)

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def num_bytes(self) -> int:
        return self._lru.num_bytes

    def get(self, namespace: str, key: str) -> Any | None:
        return self._lru.get(namespace, key)

    def put(self, namespace: str, key: str, constraint: Any, num_bytes: int) -> None:
        """Keep ``constraint`` (``num_bytes`` in memory); one over the whole budget is not kept."""
        self._lru.put(namespace, key, constraint, num_bytes)
