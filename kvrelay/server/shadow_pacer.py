"""How much engine time the shadow references may take, and when they may take it.

A shadow reference is a ``full`` prefill of a live call's prompt that nobody waits for (kvrelay.server.shadow). The
guard shadows every one of a role's first calls, its warm-up; a tenant that sends each conversation under a fresh
``cache_salt`` makes roles that die after a few calls, so every call would be warm-up and get a second, dearer
prefill. For such a tenant (the guard's ``paced`` namespaces, kvrelay.quality.turnover) the pacer holds the
shadows to a share of the live work, by three rules in engine time as the worker measures it:

1. **Taken on credit, whatever its length.** Each live turn (its prefill pieces and decode step) earns ``share`` of
   its time; a paced call is shadowed when the credit is positive without what its own prefill earned, and charged
   its reference's predicted time at once (and the difference when it ends, whole), which may leave the credit in
   debt: the next paced call is shadowed once live work has repaid it. Whether a call is shadowed depends neither on
   its own cost nor on its own prefill's time (a long prefill would otherwise earn the credit it is then shadowed
   on, and one client's long calls would be shadowed more often), so the guard's sample of a paced tenant holds
   long prompts (where reuse errors grow) as often as short ones; a rule
   that waited for the credit to cover each call's own cost would spend it on the short calls as soon as it
   covered them and almost never shadow a long one. A long reference costs its own time in the gap after it, not
   a wait before it: a call that is never shadowed holds nothing back, however long. The credit is one pool for the
   server, kept under ``CREDIT_WINDOW_S`` seconds' worth of the share. So the paced shadows take at most ``share``
   of the live compute, plus the window's credit and the last reference's time (taken on a credit just above 0).
2. **Paced while live requests run.** In a turn with live work a paced shadow runs one piece of the least size
   (the chunk budget's ``min_tokens``), only while a second credit, ``BUSY_WINDOW_S`` seconds' worth of the share,
   is positive: the running streams' decode steps wait for shadow pieces about ``share`` of their time.
3. **In idle time, not where the next call is due.** With no live work a paced shadow runs on, but a piece starts
   only once the engine has been idle for as long as the piece is predicted to take. An agent chain sends its next
   call as soon as the previous answer is back, within a few milliseconds; it finds the engine free instead of
   behind a shadow piece. A call that arrives later waits for at most one least piece.

A tenant whose roles live long (agents called again and again in one namespace) keeps its warm-up: its shadows run
as they always did, in any turn no live prefill waits for, a turn's budget a piece, and their time is spent from
the same credit (down to a window's debt at most; a deeper debt, a paced reference's, is left as it is), so a
paced tenant beside it gets less.

Pure bookkeeping on an injected clock: the worker tells it live time, shadow time and when the engine went idle.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from kvrelay.quality.config import check_shadow_share

CREDIT_WINDOW_S = 60.0  # the credit a quiet minute earns at most: a new role's first shadows need not wait for it
BUSY_WINDOW_S = 1.0  # pieces between decode steps: the share of about the last second's live work, so none bunch up


class ShadowPacer:
    """Credit and idle time for the shadow runner: ``live_turn``/``idle`` from the worker; for a paced call
    ``affordable`` then ``take`` at its first token, ``settle`` when its reference ends; ``ready_in_s`` before a
    paced piece; ``spent`` after every piece."""

    def __init__(self, share: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.share, self.clock = check_shadow_share(share), clock
        self.credit_ms = 0.0  # a fresh server has none: live work pays for the first reference
        self.busy_credit_ms = 0.0  # for paced pieces between decode steps: a short window of the same share
        self.spent_ms = 0.0  # every shadow piece's time
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

    def affordable(self, prefill_ms: float = 0.0) -> bool:
        """Whether a paced call whose own prefill took ``prefill_ms`` of live time may be shadowed now: the credit,
        less what that prefill earned, is positive (neither its cost nor its prefill is asked, so which calls are
        shadowed does not depend on their length; a fresh server waits for its first live turn)."""
        return self.credit_ms - self.share * prefill_ms > 0

    def take(self, cost_ms: float) -> None:
        """A paced reference predicted at ``cost_ms`` was taken: charged now, into debt if it costs more than the
        credit (repaid by live work before the next is taken)."""
        self.credit_ms -= cost_ms

    def settle(self, ms: float) -> None:
        """A paced reference ended: ``ms`` is its time over (or, negative, under) what it was charged, all of it."""
        self.credit_ms = min(self.cap_ms, self.credit_ms - ms)

    def ready_in_s(self, piece_ms: float) -> float:
        """Seconds until a paced piece predicted at ``piece_ms`` may start: while busy, 0 with busy credit and inf
        without; while idle, once the engine has been idle for ``piece_ms``."""
        if self._idle_since is None:
            return 0.0 if self.busy_credit_ms > 0 else math.inf
        return max(0.0, self._idle_since + piece_ms / 1e3 - self.clock())

    def spent(self, ms: float, paced: bool) -> None:
        """A shadow piece took ``ms`` of engine time: a paced one between decode steps spends the busy credit (its
        reference was charged when taken), one that is not spends the credit."""
        if not paced:  # at most a window's debt: a long-lived tenant's warm-up does not shut the paced ones out long;
            # a deeper debt is a paced reference's charge, which this floor must not forgive
            self.credit_ms = min(self.cap_ms, max(min(self.credit_ms, -self.cap_ms), self.credit_ms - ms))
        elif self._idle_since is None:
            self.busy_credit_ms -= ms
        self.spent_ms += ms
