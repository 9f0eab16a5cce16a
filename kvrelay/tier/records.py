"""Small JSON records of the server (stored responses) in the shared tier, per namespace.

A record is a JSON object kept under ``record_key(kind, namespace, id)``: hashed, so no tenant name, API key or id
appears in a key. Its value is JSON (never pickle: a value from a shared server is data, never code) that names
its kind, namespace and id, and a value read back is used only when it names exactly what was asked for: another
namespace's record, a forced key collision, a corrupt or oversized value all read as no record. Every tier call
goes through the tier's one fault wrapper (``TierHealth.call``): a failed or down tier is a miss here too,
logged once per outage, and shares its up/down state and prober with the span store of the same tier.
"""

from __future__ import annotations

import json
import logging

from kvrelay.tier.backends.base import TierBackend, record_key
from kvrelay.tier.health import TierDown, TierHealth

log = logging.getLogger("kvrelay.tier")
RECORD_VERSION = 1


class TierRecords:
    """JSON records of one ``kind`` under (namespace, id); every method answers, none raises for the tier."""

    def __init__(self, backend: TierBackend, health: TierHealth, kind: str, max_value_bytes: int) -> None:
        self.backend, self.health, self.kind = backend, health, kind
        self.max_value_bytes = max_value_bytes  # a larger value is neither written nor decoded
        self.num_bad = 0  # values read back that did not decode or named another record

    def _key(self, namespace: str, record_id: str) -> str:
        return record_key(self.kind, namespace, record_id)

    def _identity(self, namespace: str, record_id: str) -> dict:
        return {"kvrelay_record": self.kind, "v": RECORD_VERSION, "namespace": namespace, "id": record_id}

    def put(self, namespace: str, record_id: str, body: dict) -> bool:
        """Write ``body``; False when it is too large or the tier did not take it."""
        value = json.dumps({**self._identity(namespace, record_id), "body": body}).encode()
        if len(value) > self.max_value_bytes:
            return False
        meta = json.dumps({**self._identity(namespace, record_id), "value_bytes": len(value)}).encode()
        try:
            self.health.call("write record", self.backend.put, self._key(namespace, record_id), value, meta)
        except TierDown:
            return False
        return True

    def get(self, namespace: str, record_id: str) -> dict | None:
        """The body stored for (namespace, id); None when there is none, the tier is down, or the value is bad."""
        try:
            value = self.health.call("read record", self.backend.get_value, self._key(namespace, record_id))
        except TierDown:
            return None
        if value is None:
            return None
        if len(value) > self.max_value_bytes:
            return self._bad(f"a {len(value)}-byte record, over {self.max_value_bytes}")
        try:
            record = json.loads(bytes(value))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            return self._bad(f"a record that is not JSON ({e})")
        if not isinstance(record, dict) or not isinstance(record.get("body"), dict):
            return self._bad("a record without a body")
        if {k: record.get(k) for k in self._identity(namespace, record_id)} != self._identity(namespace, record_id):
            return self._bad("a record of another kind, namespace or id")
        return record["body"]

    def _bad(self, what: str) -> None:
        log.warning("shared tier %s: %s; treated as a miss", self.health.url, what)
        self.num_bad += 1
        return None

    def exists(self, namespace: str, record_id: str) -> bool:
        """Whether the tier holds the record now (marking it used); False when the tier is down."""
        try:
            return bool(self.health.call("check record", self.backend.touch, self._key(namespace, record_id)))
        except TierDown:
            return False

    def delete(self, namespace: str, record_id: str) -> bool:
        """Remove the record from the tier; False when the tier did not answer (the record may still be there)."""
        try:
            self.health.call("delete record", self.backend.delete, self._key(namespace, record_id))
        except TierDown:
            return False
        return True
