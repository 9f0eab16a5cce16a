"""Stored responses shared by the replicas on one shared tier (``--store redis://...`` or ``disk:PATH``).

With a shared tier, the tier is where a stored response lives and this process's ``ResponseStore`` only a cache of
what it wrote or read: a response exists exactly while the tier holds it. So an id is known on every replica or on
none: ``store: true`` writes the response through (one that is over the local byte bound, or that the tier does not
take, is kept nowhere); a local miss reads the tier and keeps what it finds; a local hit asks the tier whether the
response is still there (one small round trip, which also marks it used for Redis' LRU), so a DELETE on another
replica, or Redis evicting it, makes it unknown here at the next lookup; DELETE removes it from the tier. While the
tier is down, whether a response exists is not known: a lookup or DELETE is a 503 ``tier_unavailable`` (never the
400/404 of an unknown id, which would tell the client its response is gone), a response created meanwhile is not
stored, and nothing waits longer than one call's timeout (the tier's fault wrapper, shared with the span store: the
first failed call marks it down, the calls after it skip the tier). Memory-only servers keep ``ResponseStore``.
"""

from __future__ import annotations

import math

from kvrelay.cache.store import KVStore
from kvrelay.server.protocol import ApiError
from kvrelay.server.response_store import ResponseStore, ResponseStoreConfig, StoredResponse
from kvrelay.tier.records import TierRecords
from kvrelay.tier.tiered import TieredStore

RECORD_KIND = "resp"
# a record's value is its body plus its kind, namespace and id: room for those over the local bound of one response
_IDENTITY_BYTES = 4096


class SharedResponseStore(ResponseStore):
    """``ResponseStore`` whose entries live in a shared tier (see the module docstring)."""

    def __init__(self, records: TierRecords, config: ResponseStoreConfig | None = None) -> None:
        super().__init__(config)
        self.records = records

    def put(self, namespace: str, response_id: str, messages: list[dict], response: dict,
            input_items: list[dict] | None = None) -> bool:
        """Store one response here and in the tier; False (kept nowhere) when it is over the byte bound or the
        tier did not take it."""
        input_items = input_items or []
        if not super().put(namespace, response_id, messages, response, input_items):
            return False
        body = {"messages": messages, "response": response, "input_items": input_items}
        if not self.records.put(namespace, response_id, body):
            super().delete(namespace, response_id)  # unknown to the other replicas: unknown here too
            return False
        return True

    def get(self, namespace: str, response_id: str) -> StoredResponse | None:
        """The stored response; None when the tier does not hold it; ``ApiError`` 503 when the tier is down."""
        entry = super().get(namespace, response_id)
        if entry is not None:
            if self.records.exists(namespace, response_id):
                return entry
            self._check_up()  # down: this copy may still be the tier's, so it is kept for when the tier is back
            super().delete(namespace, response_id)  # deleted elsewhere or evicted
            return None
        body = self.records.get(namespace, response_id)
        if body is None:
            self._check_up()
            return None
        if not _well_formed(body, response_id):
            return None
        if not super().put(namespace, response_id, body["messages"], body["response"], body["input_items"]):
            return None  # over this replica's bound: as it would not have been stored here
        return super().get(namespace, response_id)

    def delete(self, namespace: str, response_id: str) -> bool:
        """Remove it here and from the tier; False when the tier did not hold it; ``ApiError`` 503 when the tier did
        not answer (it may still be stored there)."""
        super().delete(namespace, response_id)
        if not self.records.delete(namespace, response_id):
            self._check_up()
            return False
        return True

    def _check_up(self) -> None:
        """``ApiError`` 503 ``tier_unavailable`` while the tier is down: an unknown id is not the tier's answer."""
        health = self.records.health
        if health.up:
            return
        retry_s = math.ceil(health.prober.max_interval_s) if health.prober is not None else 1
        raise ApiError(503, "stored responses live in the shared tier (--store), which is not answering; this "
                       "response's state is unknown until it is back: retry later", "server_error",
                       code="tier_unavailable", headers={"Retry-After": str(retry_s)})


def _well_formed(body: dict, response_id: str) -> bool:
    """A stored response's shape, as ``put`` writes it (a value from a shared server is checked, never trusted)."""
    messages, response, items = body.get("messages"), body.get("response"), body.get("input_items")
    return (isinstance(messages, list) and all(isinstance(m, dict) for m in messages)
            and isinstance(response, dict) and response.get("id") == response_id
            and isinstance(items, list) and all(isinstance(i, dict) for i in items))


def response_store_for(kv_store: KVStore, config: ResponseStoreConfig | None = None) -> ResponseStore:
    """Where ``store: true`` responses live: shared by the replicas when ``kv_store`` is a shared tier, else here."""
    if not isinstance(kv_store, TieredStore):
        return ResponseStore(config)
    config = config or ResponseStoreConfig()
    records = TierRecords(kv_store.backend, kv_store.health, RECORD_KIND, config.max_bytes + _IDENTITY_BYTES)
    return SharedResponseStore(records, config)
