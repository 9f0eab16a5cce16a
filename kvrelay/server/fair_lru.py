"""A byte-bounded LRU shared by tenants, where making room never takes from a tenant holding less than another.

The server's per-namespace caches (stored responses, compiled grammars) share one byte budget, since the number of
namespaces is client-chosen (``cache_salt``). Plain LRU over all of them lets one tenant push out every other's
entries by churning its own: a tenant's agent loop then loses its stored ``previous_response_id`` because another
API key stored large conversations. Here room is made from the tenant (API key: ``tenant_of``) that holds the most
bytes, least recently used first within it, so a tenant holding no more than its share (the budget over the number
of tenants holding entries) keeps them whatever the others do. Without API keys every client is one tenant and this
is plain LRU.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from kvrelay.cache.tenancy import tenant_of


class FairLru:
    """Thread-safe map of (namespace, key) -> (value, num_bytes), at most ``max_bytes`` in all and at most
    ``max_per_namespace`` entries in one namespace (None: no count bound). ``on_evict(namespace, key, value)`` is
    called, under the map's lock, for each entry put out to make room (not for ``delete`` or a replaced key)."""

    def __init__(self, max_bytes: int, max_per_namespace: int | None = None,
                 on_evict: Callable[[str, str, Any], None] | None = None) -> None:
        if max_bytes < 1 or (max_per_namespace is not None and max_per_namespace < 1):
            raise ValueError("a cache needs room for at least one entry")
        self.max_bytes = max_bytes
        self.max_per_namespace = max_per_namespace
        self.on_evict = on_evict
        self.num_bytes = 0
        self._lock = threading.Lock()
        # tenant -> its entries, least recent first: (namespace, key) -> (value, num_bytes)
        self._by_tenant: dict[str, OrderedDict[tuple[str, str], tuple[Any, int]]] = {}
        self._bytes_of: dict[str, int] = {}  # tenant -> bytes it holds
        self._keys_of: dict[str, OrderedDict[str, None]] = {}  # namespace -> its keys, least recent first

    def __len__(self) -> int:
        with self._lock:
            return sum(len(entries) for entries in self._by_tenant.values())

    def bytes_of(self, tenant: str) -> int:
        with self._lock:
            return self._bytes_of.get(tenant, 0)

    def get(self, namespace: str, key: str) -> Any | None:
        with self._lock:
            entries = self._by_tenant.get(tenant_of(namespace))
            entry = entries.get((namespace, key)) if entries is not None else None
            if entry is None:
                return None
            entries.move_to_end((namespace, key))
            self._keys_of[namespace].move_to_end(key)
            return entry[0]

    def put(self, namespace: str, key: str, value: Any, num_bytes: int) -> bool:
        """Keep ``value`` (``num_bytes``); False, keeping nothing, when it alone is over the whole budget."""
        if num_bytes > self.max_bytes:
            return False
        tenant = tenant_of(namespace)
        with self._lock:
            self._drop(namespace, key)
            keys = self._keys_of.get(namespace)
            while self.max_per_namespace is not None and keys and len(keys) >= self.max_per_namespace:
                self._evict(namespace, next(iter(keys)))
                keys = self._keys_of.get(namespace)
            while self.num_bytes + num_bytes > self.max_bytes:
                # the heaviest tenant counts the new entry as already its own: a tenant at its share is not robbed
                # to let a heavier one grow
                heaviest = max(self._bytes_of, key=lambda t: self._bytes_of[t] + (num_bytes if t == tenant else 0))
                victim_namespace, victim_key = next(iter(self._by_tenant[heaviest]))
                self._evict(victim_namespace, victim_key)
            self._by_tenant.setdefault(tenant, OrderedDict())[(namespace, key)] = (value, num_bytes)
            self._bytes_of[tenant] = self._bytes_of.get(tenant, 0) + num_bytes
            self._keys_of.setdefault(namespace, OrderedDict())[key] = None
            self.num_bytes += num_bytes
        return True

    def delete(self, namespace: str, key: str) -> bool:
        with self._lock:
            return self._drop(namespace, key)

    def _evict(self, namespace: str, key: str) -> None:
        value = self._by_tenant[tenant_of(namespace)][(namespace, key)][0]
        self._drop(namespace, key)
        if self.on_evict is not None:
            self.on_evict(namespace, key, value)

    def _drop(self, namespace: str, key: str) -> bool:
        tenant = tenant_of(namespace)
        entries = self._by_tenant.get(tenant)
        entry = entries.pop((namespace, key), None) if entries is not None else None
        if entry is None:
            return False
        self.num_bytes -= entry[1]
        self._bytes_of[tenant] -= entry[1]
        if not entries:
            del self._by_tenant[tenant], self._bytes_of[tenant]
        keys = self._keys_of[namespace]
        del keys[key]
        if not keys:
            del self._keys_of[namespace]
        return True
