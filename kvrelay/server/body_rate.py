"""How fast one client may send large bodies: a per-client byte budget, so a flood of big requests from one client
cannot take the process's time from everyone else's.

A body under the size limit is still read, parsed as JSON and validated before anything can refuse it (a text
longer than the context is refused from its length, after that). All of that holds Python's GIL: parsing one 8 MB
body takes 20-70 ms during which the engine thread's Python (the glue between a prefill piece's kernels, the decode
loop) waits. One client sending such bodies back to back, each refused in a fraction of a second, kept the GIL
busy enough that the other requests' prefill pieces ran 1.3-1.6x their predicted time.

So each client (its API key, else its address) has a budget of ``capacity_bytes`` (the body limit: one body of
the largest size is always allowed) that refills at ``capacity_bytes`` a second, and only bodies over
``LARGE_BODY_BYTES`` draw on it: an agent's requests, kilobytes each, never do. A large body the budget cannot
cover is a 429 with ``Retry-After``, answered from its ``Content-Length`` before a byte of it is read. A chunked
body (no length given) is charged as it arrives, after the fact: it may take the budget below zero, and that
client's next large body waits longer. Nothing here needs tuning: one largest body a second per client is far
more prompt text than any engine prefills in a second (8 MB is about 2M tokens).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable

LARGE_BODY_BYTES = 1 << 20  # bodies up to this size are free: no agent's request is counted
MAX_CLIENTS = 4096  # clients with a budget below full kept at once; the fullest are forgotten first


def client_key(scope: dict) -> str:
    """Whom a request's budget belongs to: its bearer key (hashed, not kept in the clear), else its address."""
    auth = dict(scope.get("headers") or ()).get(b"authorization", b"")
    if auth:
        return "key:" + hashlib.sha256(auth).hexdigest()[:32]
    client = scope.get("client")
    return f"addr:{client[0]}" if client else "addr:?"


class BodyRate:
    """Per client, a budget of body bytes over ``LARGE_BODY_BYTES`` that refills at ``capacity_bytes`` a second."""

    def __init__(self, capacity_bytes: int, clock: Callable[[], float] = time.monotonic,
                 max_clients: int = MAX_CLIENTS) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        self.capacity_bytes, self.clock, self.max_clients = capacity_bytes, clock, max_clients
        self._levels: dict[str, tuple[float, float]] = {}  # client -> (bytes left, at what time)

    def _level(self, client: str, now: float) -> float:
        level, at = self._levels.get(client, (self.capacity_bytes, now))
        return min(self.capacity_bytes, level + (now - at) * self.capacity_bytes)

    def _set(self, client: str, level: float, now: float) -> None:
        self._levels[client] = (level, now)
        if len(self._levels) > self.max_clients:  # forget the clients whose budget is (nearly) full again
            by_level = sorted(self._levels, key=lambda c: self._level(c, now))
            for gone in by_level[self.max_clients // 2:]:
                del self._levels[gone]

    def admit(self, client: str, num_bytes: int) -> int:
        """0 and the bytes charged, if ``client`` may send a body of ``num_bytes`` now; else the whole seconds to
        wait (nothing charged)."""
        if num_bytes <= LARGE_BODY_BYTES:
            return 0
        now = self.clock()
        level = self._level(client, now)
        if level < num_bytes:
            return max(1, math.ceil((num_bytes - level) / self.capacity_bytes))
        self._set(client, level - num_bytes, now)
        return 0

    def charge(self, client: str, num_bytes: int) -> None:
        """Charge a body whose size was known only once it arrived (chunked); the budget may go below zero."""
        if num_bytes > LARGE_BODY_BYTES:
            now = self.clock()
            self._set(client, self._level(client, now) - num_bytes, now)
