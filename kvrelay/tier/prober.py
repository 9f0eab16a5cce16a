"""Probing a shared tier that is down, off every caller's thread, until it answers again.

While the tier is down no caller touches it (``TierHealth.call`` only reads a flag): a hung Redis would otherwise
cost the engine thread one client timeout per retry, a stall every running stream shares. The prober's thread alone
pays for the probes, at intervals that double from ``min_interval_s`` to ``max_interval_s``, so a tier that answers
again is back within about one interval. While the tier is up, ``probe_while_up`` pings it every
``UP_PROBE_INTERVAL_S`` on a thread of its own, so that a replica with no traffic (no call that could fail) still
finds a dead tier down within one interval. Pure Python, no torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

#: how often a tier that is up is pinged (one ``PING`` or one directory check): a replica serving no request learns
#: that the tier died within this long, so ``/health``, ``kvrelay_tier_up`` and the log say so without traffic
UP_PROBE_INTERVAL_S = 5.0


class TierProber:
    """Calls ``probe`` every interval (doubling, capped) until it returns without raising, or until ``stop``."""

    def __init__(self, probe: Callable[[], object], min_interval_s: float, max_interval_s: float,
                 wait: Callable[[float], bool] | None = None) -> None:
        """``wait(interval_s)`` sleeps before each probe and returns True when the prober was stopped meanwhile (by
        default the stop event's own wait: ``stop`` ends a sleep at once); a test passes its own to step the
        probes itself."""
        if not 0 < min_interval_s <= max_interval_s:
            raise ValueError(f"probe intervals must satisfy 0 < min <= max, got {min_interval_s}, {max_interval_s}")
        self.probe, self.min_interval_s, self.max_interval_s = probe, min_interval_s, max_interval_s
        self._stopped = threading.Event()
        self.wait = wait if wait is not None else self._stopped.wait
        self.num_probes = 0  # probes made since this prober was created, failed ones included
        self.last_error: BaseException | None = None  # why the latest failed probe failed
        self.num_up_probes = 0  # probes of a tier that was up (``probe_while_up``), failed ones included

    def wait_until_up(self) -> bool:
        """Probe until the tier answers (True) or the prober is stopped (False); runs on the prober's thread."""
        interval_s = self.min_interval_s
        while not self.wait(interval_s) and not self._stopped.is_set():
            self.num_probes += 1
            try:
                self.probe()
            except Exception as e:  # any failure is the tier still being down: probe again later
                self.last_error = e
                interval_s = min(interval_s * 2, self.max_interval_s)
                continue
            return True
        return False

    def probe_while_up(self, interval_s: float, is_up: Callable[[], bool],
                       on_failure: Callable[[BaseException], object],
                       wait: Callable[[float], bool] | None = None) -> None:
        """Until stopped: every ``interval_s``, probe the tier if ``is_up()`` and hand a failure to ``on_failure``
        (which marks it down; ``wait_until_up``, on another thread, then finds it back). While the tier is down it
        is not probed here. ``wait``: as ``__init__``'s, this loop's own (default: the stop event's)."""
        wait = wait if wait is not None else self._stopped.wait
        while not wait(interval_s) and not self._stopped.is_set():
            if not is_up():
                continue
            self.num_up_probes += 1
            try:
                self.probe()
            except Exception as e:  # the tier stopped answering: down, as after a failed call
                self.last_error = e
                on_failure(e)

    def stop(self) -> None:
        self._stopped.set()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()
