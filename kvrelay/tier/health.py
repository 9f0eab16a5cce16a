"""The shared tier's health: up or down; while down, no caller touches it and a prober thread finds when it is back.

The first failed call (an error, or a hung server's client timeout) marks the tier down. From then on every call
is skipped at the cost of reading a flag, so a dead or hung Redis or disk costs the engine thread one failed call per
outage, not one per retry; a ``TierProber`` probes it off the callers' threads and marks it up as soon as a probe
answers. The state changes are logged once each way, never per failed call. A tier that nobody calls (a replica
with no traffic) would never fail a call: ``watch`` pings it while it is up, every ``UP_PROBE_INTERVAL_S``, on a
thread of its own, and a failed ping marks it down as a failed call does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kvrelay.tier.backends.base import TierRefusedError, redact
from kvrelay.tier.prober import UP_PROBE_INTERVAL_S, TierProber

log = logging.getLogger("kvrelay.tier")


class TierDown(Exception):
    """A tier call failed or was skipped while the tier is down: the caller treats it as a miss."""


class TierHealth:
    """Up/down state; logs once per transition, never per failed call; probes a down tier on a thread of its own."""

    def __init__(self, url: str, min_backoff_s: float = 0.5, max_backoff_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, probe: Callable[[], object] | None = None,
                 wait: Callable[[float], bool] | None = None) -> None:
        """``probe``: a cheap call that raises while the tier is down (None: the tier is never marked down, since
        nothing would bring it back). ``min_backoff_s``/``max_backoff_s``: the prober's intervals. ``clock``
        (seconds): ``down_for_s``. ``wait``: the prober's sleep (``TierProber``), for a test to step it."""
        self.url, self.clock = url, clock
        self.down_since: float | None = None
        self.num_failures = 0  # calls that failed (each one while up marks the tier down)
        self.num_skipped = 0  # calls not made because the tier was down
        self.prober = None if probe is None else TierProber(probe, min_backoff_s, max_backoff_s, wait)
        self._probing = False  # a prober thread runs (set and cleared under the lock: no outage is left unprobed)
        self.probe_thread: threading.Thread | None = None  # the latest prober thread (a test joins it)
        self.watch_thread: threading.Thread | None = None  # pings the tier while it is up (``watch``)
        self._lock = threading.Lock()

    @property
    def up(self) -> bool:
        return self.down_since is None

    def available(self) -> bool:
        return self.up

    def down_for_s(self) -> float | None:
        """Seconds since the tier went down; None while it is up."""
        since = self.down_since
        return None if since is None else max(self.clock() - since, 0.0)

    def call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, the one fault wrapper of every tier call: ``TierDown`` (the caller's miss) while the tier is
        down, without calling it, or when it fails. A refusal by a live tier (``TierRefusedError``) is a warning and
        ``TierDown("tier refused")`` for this call alone; any other exception marks the tier down (logged once).
        """
        if self.down_since is not None:
            self.num_skipped += 1  # a racy count (no lock on this path): a metric, never a decision
            raise TierDown
        try:
            return fn(*args)
        except TierRefusedError as e:  # the tier is up: this operation alone failed
            log.warning("shared tier %s: %s", self.url, e)
            raise TierDown("tier refused") from None
        except Exception as e:  # any failure of the tier is a miss, never a failed request
            self.failure(what, e)
            raise TierDown from None

    def watch(self, interval_s: float = UP_PROBE_INTERVAL_S, wait: Callable[[float], bool] | None = None) -> None:
        """Ping the tier every ``interval_s`` while it is up, on a thread of its own, until ``close``: a failed ping
        marks it down (one warning, as a failed call's) and the prober finds it back. No effect without a probe or
        when already watching. ``wait``: the watcher's sleep (``TierProber.probe_while_up``), for a test to step it."""
        if self.prober is None or self.watch_thread is not None:
            return
        self.watch_thread = threading.Thread(target=self.prober.probe_while_up,
                                             args=(interval_s, lambda: self.up, self._ping_failed, wait),
                                             name="kvrelay-tier-watch", daemon=True)
        self.watch_thread.start()

    def _ping_failed(self, exc: BaseException) -> None:
        with self._lock:  # not a caller's failed call: not counted in ``num_failures``
            self._mark_down("ping", exc)

    def failure(self, what: str, exc: BaseException) -> None:
        with self._lock:
            self.num_failures += 1
            self._mark_down(what, exc)

    def _mark_down(self, what: str, exc: BaseException) -> None:
        """Down (logged once), with a prober thread running; the caller holds the lock."""
        if self.prober is None or self.prober.stopped:  # nothing would mark it up again: stay up, retry per call
            return
        if self.down_since is None:
            self.down_since = self.clock()
            log.warning("shared tier %s unavailable (%s: %s: %s); serving from memory, probing it in the "
                        "background", self.url, what, type(exc).__name__, redact(str(exc)))
        if not self._probing:
            self._probing = True
            self.probe_thread = threading.Thread(target=self._probe_until_up, name="kvrelay-tier-prober",
                                                 daemon=True)
            self.probe_thread.start()

    def _probe_until_up(self) -> None:
        up = self.prober.wait_until_up()
        with self._lock:
            self._probing = False
            if up and self.down_since is not None:
                log.warning("shared tier %s is back after %.1f s", self.url, self.clock() - self.down_since)
                self.down_since = None

    def close(self) -> None:
        """Stop probing (a closed store's tier stays as it is)."""
        if self.prober is not None:
            self.prober.stop()
