"""Span records of the shared tier found unreadable: each counted and warned about once, then skipped unread.

One request looks the same span up several times (the exact prefix, the index's runs, the pin), so a record read
anew at each lookup was counted and logged once per read: three WARNINGs and +3 for one bad value. The keys found bad
are remembered (the most recent ``max_keys``; an older one is read, found bad and counted again), and a lookup of one
is a miss without a tier call. A key this process writes again is forgotten (its new value is read); a good value
another process writes under a remembered key is skipped until the key falls out of the memory. Pure Python.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

log = logging.getLogger("kvrelay.tier")
MAX_BAD_KEYS = 4096  # keys of bad records remembered (a few hundred KB at most)


class BadRecords:
    """Counts of bad span records by kind, and the keys of the most recent ones."""

    def __init__(self, url: str, max_keys: int = MAX_BAD_KEYS) -> None:
        self.url, self.max_keys = url, max_keys
        self.num_by_kind = {"metadata": 0, "value": 0}  # distinct bad records found since the store opened
        self._keys: OrderedDict[str, str] = OrderedDict()  # key -> kind, least recently found first
        self._lock = threading.Lock()

    def known(self, key: str) -> bool:
        return key in self._keys

    def add(self, key: str, kind: str, why: str) -> None:
        """Count and warn once for ``key`` (a record of ``kind`` that did not decode, ``why``)."""
        with self._lock:
            if key in self._keys:  # another thread found it first
                return
            self._keys[key] = kind
            while len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)
            self.num_by_kind[kind] += 1
        # the key, as docs/tier.md's key table writes it (no tenant name in it), so an operator can delete the record
        log.warning("shared tier %s: %s (span %s, %s); treated as a miss and skipped from now on", self.url, why,
                    key, kind)

    def forget(self, key: str) -> None:
        """``key`` was written anew: read it again."""
        with self._lock:
            self._keys.pop(key, None)
