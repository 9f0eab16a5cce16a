"""Stored responses of ``/v1/responses`` (``store: true``), for ``previous_response_id`` and ``GET``.

A stored response keeps the conversation it ended (as chat messages, instructions excluded: OpenAI does
not carry them over) and the response object returned. Entries live under the caller's namespace (API
key, ``cache_salt``): a lookup from another namespace misses exactly like an unknown id, so ids leak
nothing across tenants. Two bounds, both LRU: entries per namespace (one tenant's churn evicts only its
own responses) and total bytes (``cache_salt`` is client-chosen, so the number of namespaces is not).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredResponse:
    messages: list[dict]  # the whole conversation as chat messages, this response's output included
    response: dict  # the response object as returned
    num_bytes: int


@dataclass(frozen=True)
class ResponseStoreConfig:
    max_per_namespace: int = 256
    max_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if self.max_per_namespace < 1 or self.max_bytes < 1:
            raise ValueError("the response store needs room for at least one response")


class ResponseStore:
    """Thread-safe bounded LRU of (namespace, response id) -> ``StoredResponse``."""

    def __init__(self, config: ResponseStoreConfig | None = None) -> None:
        self.config = config or ResponseStoreConfig()
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()
        self._ids_of: dict[str, OrderedDict[str, None]] = {}  # namespace -> its ids, oldest first
        self._lock = threading.Lock()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, namespace: str, response_id: str, messages: list[dict], response: dict) -> bool:
        """Store one response; False when it alone is over the byte budget (it is then not stored)."""
        num_bytes = len(json.dumps(messages)) + len(json.dumps(response))
        if num_bytes > self.config.max_bytes:
            return False
        with self._lock:
            self._drop((namespace, response_id))
            ids = self._ids_of.setdefault(namespace, OrderedDict())
            while len(ids) >= self.config.max_per_namespace:
                self._drop((namespace, next(iter(ids))))
                ids = self._ids_of.setdefault(namespace, OrderedDict())
            while self.num_bytes + num_bytes > self.config.max_bytes:
                self._drop(next(iter(self._entries)))
            ids = self._ids_of.setdefault(namespace, OrderedDict())
            self._entries[(namespace, response_id)] = StoredResponse(messages, response, num_bytes)
            ids[response_id] = None
            self.num_bytes += num_bytes
        return True

    def get(self, namespace: str, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get((namespace, response_id))
            if entry is not None:
                self._entries.move_to_end((namespace, response_id))
                self._ids_of[namespace].move_to_end(response_id)
            return entry

    def delete(self, namespace: str, response_id: str) -> bool:
        with self._lock:
            return self._drop((namespace, response_id))

    def _drop(self, key: tuple[str, str]) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.num_bytes -= entry.num_bytes
        ids = self._ids_of[key[0]]
        del ids[key[1]]
        if not ids:
            del self._ids_of[key[0]]
        return True
