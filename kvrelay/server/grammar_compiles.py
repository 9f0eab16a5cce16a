"""Where a request's grammar is compiled (and its tools' schemas validated, kvrelay.server.tools.plan_tools): off
the event loop, on threads of its own, one at a time per tenant (API key).

A compile takes from milliseconds to seconds (kvrelay.server.schemas bounds how long), and cannot be interrupted
once started. On asyncio's default executor (a handful of threads on a small machine) a few slow compiles of one
tenant would hold every thread, and every other request that goes to that executor would wait behind them.
Here one tenant's compiles queue behind each other only, so another tenant's compile gets the next free thread,
and a client that goes away mid-compile keeps its tenant's turn until the compile ends (the thread is still busy).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from kvrelay.server.protocol import ApiError

T = TypeVar("T")
NUM_COMPILE_THREADS = 2  # compiles of different tenants at once; each compile uses one thread
# a tenant's requests waiting for its turn, each holding its body: one more is a 429 (as the server's queue, 64)
MAX_WAITING_PER_TENANT = 64


class GrammarCompiles:
    """Runs compiles on ``num_threads`` threads, at most one per tenant at a time (``run``)."""

    def __init__(self, num_threads: int = NUM_COMPILE_THREADS) -> None:
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="kvrelay-grammar")
        self._turns: dict[str, tuple[asyncio.Lock, list[int]]] = {}  # tenant -> its lock, [num requests using it]

    async def run(self, tenant: str, compile_fn: Callable[..., T], *args) -> T:
        """``compile_fn(*args)`` on a compile thread once ``tenant`` has no other compile running."""
        lock, num_users = self._turns.setdefault(tenant, (asyncio.Lock(), [0]))
        if num_users[0] > MAX_WAITING_PER_TENANT:  # one compiling, the rest waiting
            raise ApiError(429, f"{MAX_WAITING_PER_TENANT} requests of this tenant already wait for their tools' or "
                           "format's grammar to compile; retry later", "rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"})
        num_users[0] += 1
        try:
            await lock.acquire()
        except BaseException:  # cancelled while waiting for its turn: nothing started
            self._leave(tenant, num_users)
            raise
        try:
            future = asyncio.get_running_loop().run_in_executor(self._pool, compile_fn, *args)
        except BaseException:  # the threads are shut down: the turn is given back
            lock.release()
            self._leave(tenant, num_users)
            raise

        def finished(_) -> None:  # the turn ends with the compile, not with the request that asked for it
            lock.release()
            self._leave(tenant, num_users)

        future.add_done_callback(finished)
        return await asyncio.shield(future)

    def _leave(self, tenant: str, num_users: list[int]) -> None:
        num_users[0] -= 1
        if num_users[0] == 0:  # no request of this tenant holds or waits for the lock: forget it
            del self._turns[tenant]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
