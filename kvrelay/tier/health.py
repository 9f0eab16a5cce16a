"""The shared tier's health: up or down, and when to try it again (exponential backoff).

A tier that fails is not called again until its backoff has passed, so a dead Redis or disk costs one failed
call per backoff, not one per request; the state changes are logged once each way, never per failed call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kvrelay.tier.backends.base import TierRefusedError, redact

log = logging.getLogger("kvrelay.tier")


class TierDown(Exception):
    """A tier call failed or was skipped while the tier is backing off: the caller treats it as a miss."""


class TierHealth:
    """Up/down state with exponential backoff; logs once per transition, never per failed call."""

    def __init__(self, url: str, min_backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``clock`` (seconds): when the backoff ends; a test passes its own to let the backoff pass on its word."""
        self.url, self.min_backoff_s, self.max_backoff_s, self.clock = url, min_backoff_s, max_backoff_s, clock
        self.down_since: float | None = None
        self.num_failures = 0
        self._backoff_s = min_backoff_s
        self._next_try = 0.0
        self._lock = threading.Lock()

    def available(self) -> bool:
        return self.clock() >= self._next_try

    def call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, the one fault wrapper of every tier call: ``TierDown`` (the caller's miss) while backing off
        or when it fails. A refusal by a live tier (``TierRefusedError``) is a warning and ``TierDown("tier
        refused")`` for this call alone; any other exception marks the tier down (logged once) and starts the backoff.
        """
        if not self.available():
            raise TierDown
        try:
            out = fn(*args)
        except TierRefusedError as e:  # the tier is up: this operation alone failed
            log.warning("shared tier %s: %s", self.url, e)
            raise TierDown("tier refused") from None
        except Exception as e:  # any failure of the tier is a miss, never a failed request
            self.failure(what, e)
            raise TierDown from None
        self.success()
        return out

    def failure(self, what: str, exc: BaseException) -> None:
        with self._lock:
            self.num_failures += 1
            now = self.clock()
            if self.down_since is None:
                self.down_since, self._backoff_s = now, self.min_backoff_s
                log.warning("shared tier %s unavailable (%s: %s: %s); serving from memory, retrying with backoff",
                            self.url, what, type(exc).__name__, redact(str(exc)))
            else:
                self._backoff_s = min(self._backoff_s * 2, self.max_backoff_s)
            self._next_try = now + self._backoff_s

    def success(self) -> None:
        if self.down_since is None:
            return
        with self._lock:
            if self.down_since is not None:
                log.warning("shared tier %s is back after %.1f s", self.url, self.clock() - self.down_since)
                self.down_since, self._next_try = None, 0.0
