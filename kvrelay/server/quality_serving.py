"""The quality guard as the server uses it: one lock around it, and the rung each request runs at.

The guard (``kvrelay.quality.QualityGuard``) is plain bookkeeping; the server calls it from two threads (the
routes pick a request's method on the event loop, the engine worker records shadow comparisons), so every call
goes through one lock here. A role is the agent (``x-kvrelay-agent``, or the system prompt's digest) within the
tenant's namespace: the guard keys everything by (namespace, role), so one tenant's traffic never moves another
tenant's rung.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvrelay.quality.guard import requested_setting


@dataclass(frozen=True)
class QualityTag:
    """What a request carries for the guard: its role, the rung the role is at, and the setting it was measured
    under (the rung's name, or ``requested:SPEC`` for the method spec the request named itself)."""

    role: str
    rung: str
    measured_as: str

    def public(self) -> dict:
        """The response's ``kvrelay.quality`` object."""
        return {"role": self.role, "rung": self.rung}


class ServedGuard:
    """Thread-safe access to one ``QualityGuard`` (any object with its interface)."""

    def __init__(self, guard: Any) -> None:
        self.guard = guard
        self._lock = threading.Lock()

    def pick(self, namespace: str, role: str, requested_method: str | None, default_method: str
             ) -> tuple[str, QualityTag]:
        """The method a request runs and its tag. A request that names its own method keeps it (still measured,
        under that spec); otherwise the role's current rung picks it."""
        with self._lock:
            rung = self.guard.rung_for(namespace, role, bool(requested_method))
        if requested_method:
            return requested_method, QualityTag(role, rung.name, requested_setting(requested_method))
        return rung.method_spec or default_method, QualityTag(role, rung.name, rung.name)

    def paced(self, namespace: str) -> bool:
        with self._lock:
            return bool(self.guard.paced(namespace))

    def should_shadow(self, namespace: str, role: str, affordable: bool | Callable[[], bool] = True,
                      setting: str | None = None) -> bool:
        with self._lock:
            return bool(self.guard.should_shadow(namespace, role, affordable, setting))

    def record(self, namespace: str, role: str, rung_name: str, first_token_kl: float, top1_agree: bool,
               continuation_kl: float | None, shadow_cost_ms: float) -> None:
        with self._lock:
            self.guard.record(namespace, role, rung_name, first_token_kl, top1_agree, continuation_kl,
                              shadow_cost_ms)

    def snapshot(self, namespace: str) -> dict:
        with self._lock:
            return self.guard.snapshot(namespace)

    def call(self, name: str, *args: Any) -> Any:
        """Any other guard method, under the lock (the metrics' aggregates)."""
        with self._lock:
            return getattr(self.guard, name)(*args)

    def aggregates(self) -> dict:
        """Namespace-safe sums for ``/metrics``: ``{"rung_moves": {direction: n}, "roles_per_rung": {rung: n}}``."""
        with self._lock:
            return self.guard.aggregates()


def requested_method(body: Any) -> str | None:
    """The method spec a request named itself (``{"kvrelay": {"method": ...}}``), or None."""
    ext = getattr(body, "kvrelay", None)
    method = getattr(ext, "method", None) if ext is not None else None
    return method.strip() if method and method.strip() else None
