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
cover waits, unread, until it can (an idle coroutine; the connection's reading is paused by its flow control), so
a client that sends them back to back is slowed to its budget instead of answered at once and invited to send the
next: answered with an immediate 429, such a client came back a hundred times a second, and each attempt cost the
server part of a body's reading. A body that would wait more than ``MAX_WAIT_S``, or that finds ``MAX_WAITING`` of
its client's bodies already waiting, is a 429 with ``Retry-After``, answered from its ``Content-Length`` before a
byte of it is read. A chunked body (no length given) is charged as it arrives, after the fact: it may take the
budget below zero, and that client's next large body waits longer. Nothing here needs tuning: one largest body a
second per client is far more prompt text than any engine prefills in a second (8 MB is about 2M tokens).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable

LARGE_BODY_BYTES = 1 << 20  # bodies up to this size are free: no agent's request is counted
MAX_CLIENTS = 4096  # clients with a budget below full kept at once; the fullest are forgotten first
MAX_WAIT_S = 30.0  # a large body that would wait longer for its client's budget is a 429
MAX_WAITING = 4  # a client's large bodies waiting at once; one more is a 429


def client_key(scope: dict, api_keys: frozenset[str] = frozenset()) -> str:
    """Whom a request's budget belongs to: its API key when it is one of ``api_keys`` (hashed, not kept in the
    clear), else its address: a made-up key must not buy a fresh budget."""
    auth = dict(scope.get("headers") or ()).get(b"authorization", b"").decode("latin-1")
    key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    if key and key in api_keys:
        return "key:" + hashlib.sha256(key.encode()).hexdigest()[:32]
    client = scope.get("client")
    return f"addr:{client[0]}" if client else "addr:?"


class BodyRate:
    """Per client, a budget of body bytes over ``LARGE_BODY_BYTES`` that refills at ``capacity_bytes`` a second."""

    def __init__(self, capacity_bytes: int, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep, max_clients: int = MAX_CLIENTS) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        self.capacity_bytes, self.clock, self.sleep, self.max_clients = capacity_bytes, clock, sleep, max_clients
        self._levels: dict[str, tuple[float, float]] = {}  # client -> (bytes left, at what time)
        self._waiting: Counter[str] = Counter()  # client -> its large bodies waiting for the budget now

    def _level(self, client: str, now: float) -> float:
        level, at = self._levels.get(client, (self.capacity_bytes, now))
        return min(self.capacity_bytes, level + (now - at) * self.capacity_bytes)

    def _set(self, client: str, level: float, now: float) -> None:
        self._levels[client] = (level, now)
        if len(self._levels) > self.max_clients:  # forget the clients whose budget is (nearly) full again
            by_level = sorted(self._levels, key=lambda c: self._level(c, now))
            for gone in by_level[self.max_clients // 2:]:
                del self._levels[gone]

    def admit(self, client: str, num_bytes: int | None) -> float:
        """0 and the bytes charged, if ``client`` may send a body of ``num_bytes`` now; else the seconds until its
        budget covers it (nothing charged). ``None``: a body of unknown length, which needs a budget not below zero
        (it is charged as it arrives)."""
        now = self.clock()
        if num_bytes is None:
            return max(0.0, -self._level(client, now)) / self.capacity_bytes
        if num_bytes <= LARGE_BODY_BYTES:
            return 0.0
        level = self._level(client, now)
        if level < num_bytes:
            return (num_bytes - level) / self.capacity_bytes
        self._set(client, level - num_bytes, now)
        return 0.0

    async def wait_turn(self, client: str, num_bytes: int | None) -> int:
        """Wait until ``client``'s budget covers a body of ``num_bytes`` and charge it: 0; or, when that would take
        over ``MAX_WAIT_S`` or ``MAX_WAITING`` of its bodies wait already, the whole seconds to retry after. A body
        of unknown length (None) waits until the budget is no longer below zero and is charged as it arrives."""
        wait_s = self.admit(client, num_bytes)
        if not wait_s:
            return 0
        if wait_s > MAX_WAIT_S or self._waiting[client] >= MAX_WAITING:
            return max(1, math.ceil(wait_s))
        self._waiting[client] += 1
        waited_s = 0.0
        try:
            while wait_s:  # another of its bodies may take the budget first: wait again
                if waited_s + wait_s > MAX_WAIT_S:
                    return max(1, math.ceil(wait_s))
                await self.sleep(wait_s)
                waited_s += wait_s
                wait_s = self.admit(client, num_bytes)
        finally:
            self._waiting[client] -= 1
            if not self._waiting[client]:
                del self._waiting[client]
        return 0

    def charge(self, client: str, num_bytes: int) -> None:
        """Charge a body whose size was known only once it arrived (chunked); the budget may go below zero."""
        if num_bytes > LARGE_BODY_BYTES:
            now = self.clock()
            self._set(client, self._level(client, now) - num_bytes, now)
