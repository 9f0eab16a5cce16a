"""The shared tier's writes off the publishing thread: a tiered store's puts go to memory at once and to the tier on
a thread of this object's own.

Why: a put written through on the caller's thread encodes the span and sends it before returning (a 1,024-token
span of SmolLM2 is 50 MB: about a third of a second to Redis from Python, BENCHMARKS.md "Shared tier"). In the
server the caller is the engine thread, which publishes a finished request's span between two decode steps, so
every stream of the batch waited that long once per finished request, and a tier that stopped answering held it
for a whole call's timeout. With a writer, the put only records that the span is owed to the tier; the writer
writes what is owed, oldest first, each span as it is in memory then (one evicted meanwhile is not written: memory
bounds what waits, and another replica that misses it recomputes, as it would a span that was never shared). The
tier's own fault handling is unchanged: while it is down, what is owed waits for the next write after it is back.

Another replica finds a span once it is written (after a third of a second for the span above, longer behind a
backlog), not when the request that made it has finished: the tier is a cache, and a span not there yet is a miss.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvrelay.tier.tiered import TieredStore

log = logging.getLogger("kvrelay.tier")


class TierWriter:
    """Writes what ``store``'s puts owe the tier on a thread of its own, from ``start`` to ``stop``."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self.thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stopping = False
        self._idle = threading.Condition()
        self._writing = False

    def start(self) -> None:
        """Take the store's writes from now on."""
        self._stopping = False
        self.thread = threading.Thread(target=self._run, name="kvrelay-tier-writer", daemon=True)
        self.thread.start()
        self.store.writer = self

    def wake(self) -> None:
        """A put owes the tier a span (called by the store)."""
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._idle:
                self._writing = True
            try:
                self.store.flush_unwritten()
            except Exception:  # a writer that died would leave every later span unwritten, silently
                log.exception("writing spans to the shared tier failed; later puts will try again")
            finally:
                with self._idle:
                    self._writing = False
                    self._idle.notify_all()
            if self._stopping:
                return

    def wait_written(self, timeout_s: float | None = None) -> bool:
        """Block until nothing is owed to the tier (or the tier is down and the rest waits for it); False when
        ``timeout_s`` passed first. For a test that reads another replica, and for ``stop``."""
        def done() -> bool:
            return not self._writing and not self._wake.is_set() and (
                self.store.num_unwritten == 0 or not self.store.health.up)

        with self._idle:
            return self._idle.wait_for(done, timeout_s)

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Write what is owed, for at most ``timeout_s``, and hand writes back to the callers' threads; False when
        some were left unwritten (the tier slow or down)."""
        self.store.writer = None
        thread, self.thread = self.thread, None
        if thread is None:
            return True
        self._stopping = True
        self._wake.set()
        thread.join(timeout_s)
        return not thread.is_alive() and self.store.num_unwritten == 0
