"""How much engine time the shadow references may take, and when they may take it.

A shadow reference is a ``full`` prefill of a live call's prompt that nobody waits for (kvrelay.server.shadow). The
guard asks for one on every call of a role's first calls, so traffic whose roles never get past their first calls
(a client that sends each conversation under a fresh ``cache_salt``: a namespace per conversation, every call its
role's first) would get a second, dearer prefill on every call. The pacer holds the shadows to a share of the live
work whatever the guard asks, by three rules in engine time as the worker measures it:

1. **Taken only on credit.** Each live turn (its prefill pieces and decode step) earns ``share`` of its time, up
   to ``CREDIT_WINDOW_S`` seconds' worth of the share; every shadow piece spends what it took. A sampled call is
   shadowed only while the credit is positive (a call the guard wants then is not counted, so its cadence waits for
   one that can be), so over a run shadows take at most ``share`` of the live compute, plus the window's credit and
   the shadows already taken.
2. **Paced while live requests run.** In a turn with live work a shadow runs one piece of the least size (the
   chunk budget's ``min_tokens``), only while a second credit, of ``BUSY_WINDOW_S`` seconds' worth of the share,
   is positive too: the running streams' decode steps wait for shadow pieces about ``share`` of their time, also
   while the first credit is high (a fresh server's), not for a piece every turn.
3. **In idle time, not where the next call is due.** With no live work, shadows already taken run on without
   credit (so a server whose traffic stops drains them), but a piece starts only once the engine has been idle
   for as long as the piece is predicted to take. An agent chain sends its next call as soon as the previous
   answer is back, within a few milliseconds; it finds the engine free instead of behind a shadow piece. A call
   that arrives later than that waits at most one least piece, and only while shadows are pending.

Pure bookkeeping on an injected clock: the worker tells it live time, shadow time and when the engine went idle.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from kvrelay.errors import ConfigError

CREDIT_WINDOW_S = 60.0  # the credit a quiet minute earns at most: a new role's first shadows need not wait for it
BUSY_WINDOW_S = 1.0  # pieces between decode steps: the share of about the last second's live work, so none bunch up


class ShadowPacer:
    """Credit and idle time for the shadow runner: ``live_turn``/``idle`` from the worker, ``affordable`` at a sampled
    call's first token, ``ready_in_s`` before a piece, ``spent`` after it."""

    def __init__(self, share: float, clock: Callable[[], float] = time.perf_counter) -> None:
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not (0 < share <= 1):
            raise ConfigError(f"quality shadow share must be in (0, 1], got {share!r}")
        self.share, self.clock = float(share), clock
        self.credit_ms = self.cap_ms  # a fresh server has a window's credit
        self.busy_credit_ms = 0.0  # for pieces between decode steps: earned and spent as the credit, a short window
        self.spent_ms = 0.0
        self._idle_since: float | None = None  # when the engine's live work last ended; None while there is some

    @property
    def cap_ms(self) -> float:
        return self.share * CREDIT_WINDOW_S * 1e3

    def live_turn(self, ms: float) -> None:
        """A turn with live work took ``ms`` of engine time (it earns credit; the engine is busy)."""
        self._idle_since = None
        if ms > 0:
            self.credit_ms = min(self.cap_ms, self.credit_ms + self.share * ms)
            self.busy_credit_ms = min(self.share * BUSY_WINDOW_S * 1e3, self.busy_credit_ms + self.share * ms)

    def idle(self) -> None:
        """The engine has no live work now (idle time counts from the first call after live work)."""
        if self._idle_since is None:
            self._idle_since = self.clock()

    @property
    def is_idle(self) -> bool:
        return self._idle_since is not None

    @property
    def affordable(self) -> bool:
        """Whether a call the guard samples may be shadowed now."""
        return self.credit_ms > 0

    def ready_in_s(self, piece_ms: float) -> float:
        """Seconds until a shadow piece predicted at ``piece_ms`` may start: while busy, 0 with both credits and inf
        without; while idle, once the engine has been idle for ``piece_ms``."""
        if self._idle_since is None:
            return 0.0 if self.credit_ms > 0 and self.busy_credit_ms > 0 else math.inf
        return max(0.0, self._idle_since + piece_ms / 1e3 - self.clock())

    def spent(self, ms: float) -> None:
        """A shadow piece took ``ms`` of engine time (a piece between decode steps spends the busy credit too)."""
        self.credit_ms -= ms
        if self._idle_since is None:
            self.busy_credit_ms -= ms
        self.spent_ms += ms
