"""Stored responses of ``/v1/responses`` (``store: true``), for ``previous_response_id`` and ``GET``.

A stored response keeps the conversation it ended (as chat messages, instructions excluded: OpenAI does not carry
them over), the response object returned and the items it was generated from (for ``input_items``), all three
counted in its bytes. Entries live under the caller's namespace (API key, ``cache_salt``): a lookup from another
namespace misses exactly like an unknown id, so ids leak nothing across tenants. Two bounds: entries per namespace
(one namespace's churn evicts only its own least recent responses) and total bytes (``cache_salt`` is client-chosen,
so the number of namespaces is not), where room is made from the API key holding the most bytes (``FairLru``): one
tenant's large conversations never push out the stored responses of a tenant holding less.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from kvrelay.server.fair_lru import FairLru


@dataclass(frozen=True)
class StoredResponse:
    messages: list[dict]  # the whole conversation as chat messages, this response's output included
    response: dict  # the response object as returned
    num_bytes: int
    # the items it was generated from, with ids (kvrelay.server.responses_items): what ``input_items`` lists
    input_items: list[dict] = field(default_factory=list)


@dataclass(frozen=True)
class ResponseStoreConfig:
    max_per_namespace: int = 256
    max_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if self.max_per_namespace < 1 or self.max_bytes < 1:
            raise ValueError("the response store needs room for at least one response")


class ResponseStore:
    """Thread-safe bounded store of (namespace, response id) -> ``StoredResponse`` (``FairLru``)."""

    def __init__(self, config: ResponseStoreConfig | None = None) -> None:
        self.config = config or ResponseStoreConfig()
        self._lru = FairLru(self.config.max_bytes, self.config.max_per_namespace)

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def num_bytes(self) -> int:
        return self._lru.num_bytes

    def put(self, namespace: str, response_id: str, messages: list[dict], response: dict,
            input_items: list[dict] | None = None) -> bool:
        """Store one response; False when it alone is over the byte budget (it is then not stored)."""
        input_items = input_items or []
        num_bytes = len(json.dumps(messages)) + len(json.dumps(response)) + len(json.dumps(input_items))
        entry = StoredResponse(messages, response, num_bytes, input_items)
        return self._lru.put(namespace, response_id, entry, num_bytes)

    def get(self, namespace: str, response_id: str) -> StoredResponse | None:
        return self._lru.get(namespace, response_id)

    def delete(self, namespace: str, response_id: str) -> bool:
        return self._lru.delete(namespace, response_id)
