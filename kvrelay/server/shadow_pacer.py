"""How much engine time the shadow references may take, and when they may take it.

A shadow reference is a ``full`` prefill of a live call's prompt that nobody waits for (kvrelay.server.shadow). The
guard shadows every one of a role's first calls, its warm-up; a tenant that sends each conversation under a fresh
``cache_salt`` makes roles that die after a few calls, so every call would be warm-up and get a second, dearer
prefill. For such a tenant (the guard's ``paced`` namespaces, kvrelay.quality.turnover) the pacer holds the
shadows to a share of the live work, by three rules in engine time as the worker measures it:

1. **Drawn at one rate, whatever its length.** Each paced call is shadowed with probability ``rate``, the same for
   every call, drawn from a seeded generator (the same traffic gets the same shadows): the rate that makes the
   expected cost the share, ``(share * live - unpaced) / asked`` at most 1, over exponentially decayed sums of about
   the last ``RATE_WINDOW_CALLS`` offered calls (live time, the shadow time of tenants that are not paced, and the
   offered calls' predicted references, the call's own included). A call is offered only when the guard wants it
   shadowed (a role's warm-up or cadence), so the share is spent on the calls that want it. Any rule of the form "the
   first call after the credit turns positive" samples calls in proportion to the live time before them, so the call
   after a long document's chain (which holds more live time) is the likelier one, and long prompts are shadowed more
   often; a rule that waited for the credit to cover each call's own cost would spend it on the short calls. Drawn
   independently, a long call is as likely as a short one, so the guard's sample of a paced tenant holds long prompts
   (where reuse errors grow) as often as short ones, and an outlier lowers the rate only by its part of the window's
   asked cost. A credit bounds the draws: it earns ``share`` of the live time (``cap_ms`` at most), a taken reference
   is charged its predicted time at once (and the difference when it ends, whole), and no paced call is shadowed
   while it is more than ``cap_ms`` in debt, so a run of lucky draws takes at most the share plus twice ``cap_ms``
   and one reference. ``cap_ms`` is a minute's share, or ``CREDIT_WINDOW_REFS`` mean references where that is more: a
   band narrower than a few references would refuse many draws after each long one, and spend less than the share.
   The credit is one pool for the server.
2. **Paced while live requests run.** In a turn with live work a paced shadow runs one piece, as any shadow
   beside a decode step no more than the chunk budget's ``min_tokens`` (kvrelay.server.shadow), only while a
   second credit, ``BUSY_WINDOW_S`` seconds' worth of the share,
   is positive: the running streams' decode steps wait for shadow pieces about ``share`` of their time.
3. **In idle time, not where the next call is due.** With no live work a paced shadow runs on, but a piece starts
   only once the engine has been idle for as long as the piece is predicted to take. An agent chain sends its next
   call as soon as the previous answer is back, within a few milliseconds; it finds the engine free instead of
   behind a shadow piece. A call that arrives later waits for at most one least piece.

A tenant whose roles live long (agents called again and again in one namespace) keeps its warm-up: its shadows run
in any turn no live prefill waits for, on no credit (small pieces beside decode steps, pieces as long as the engine
has been idle, kvrelay.server.shadow), and their time is spent from
the same share (the rate's window, and the credit down to ``cap_ms`` of debt at most; a deeper debt, a paced
reference's, is left as it is), so a paced tenant beside it gets less, and none while those shadows take the whole
share of the window (a paced tenant's own warm-up, before it was judged, counts the same).

Pure bookkeeping on an injected clock: the worker tells it live time, shadow time and when the engine went idle.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable

from kvrelay.quality.config import check_shadow_share

CREDIT_WINDOW_S = 60.0  # the credit's bound (``cap_ms``): a minute's share, or this many mean references if more
CREDIT_WINDOW_REFS = 16
BUSY_WINDOW_S = 1.0  # pieces between decode steps: the share of about the last second's live work, so none bunch up
RATE_WINDOW_CALLS = 256  # the rate is learned over about the last this many offered calls
DEFAULT_SEED = 0x5EED  # the draws' seed: the same traffic gets the same shadows


class ShadowPacer:
    """The rate, the credit and idle time for the shadow runner: ``live_turn``/``idle`` from the worker; for a paced
    call ``affordable`` (its predicted cost) then ``take`` at its first token, ``settle`` when its reference ends;
    ``ready_in_s`` before a paced piece; ``spent`` after every piece."""

    def __init__(self, share: float, clock: Callable[[], float] = time.perf_counter, seed: int = DEFAULT_SEED) -> None:
        self.share, self.clock = check_shadow_share(share), clock
        self.rng = random.Random(seed)
        self.rate = 0.0  # the chance the last offered call had; a fresh server has none until live work is done
        self.live_window_ms = 0.0  # live time, unpaced shadow time and offered calls' predicted references, each
        self.unpaced_window_ms = 0.0  # decayed by 1 / RATE_WINDOW_CALLS at each offer
        self.asked_window_ms = 0.0
        self.credit_ms = 0.0  # the safety bound: earned at the share, charged each reference, refused past a debt
        self.busy_credit_ms = 0.0  # for paced pieces between decode steps: a short window of the same share
        self.spent_ms = 0.0  # every shadow piece's time
        self._idle_since: float | None = None  # when the engine's live work last ended; None while there is some

    @property
    def cap_ms(self) -> float:
        """The most credit, and the deepest debt a paced call is shadowed on: a minute's share, or
        ``CREDIT_WINDOW_REFS`` of the rate window's mean reference where that is more (a band narrower than a few
        references would refuse the draws after each long one, and the share would not be spent)."""
        mean_ref_ms = self.asked_window_ms / RATE_WINDOW_CALLS
        return max(self.share * CREDIT_WINDOW_S * 1e3, CREDIT_WINDOW_REFS * mean_ref_ms)

    def live_turn(self, ms: float) -> None:
        """A turn with live work took ``ms`` of engine time (it earns credit; the engine is busy)."""
        self._idle_since = None
        if ms > 0:
            self.live_window_ms += ms
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
    def idle_ms(self) -> float | None:
        """How long the engine has had no live work (None: it has some)."""
        return None if self._idle_since is None else max(0.0, self.clock() - self._idle_since) * 1e3

    def affordable(self, cost_ms: float) -> bool:
        """Whether a paced call whose reference is predicted at ``cost_ms`` is shadowed: the windows move on by one
        offer, its cost is asked, and it is drawn at the rate that spends the share on what the window's calls
        asked, the same for every call (a long one no likelier than a short one); refused, whatever the draw, while
        the credit is more than ``cap_ms`` in debt."""
        keep = 1.0 - 1.0 / RATE_WINDOW_CALLS
        self.live_window_ms *= keep
        self.unpaced_window_ms *= keep
        self.asked_window_ms = self.asked_window_ms * keep + max(0.0, cost_ms)
        left_ms = max(0.0, self.share * self.live_window_ms - self.unpaced_window_ms)
        self.rate = min(1.0, left_ms / self.asked_window_ms) if self.asked_window_ms > 0 else float(left_ms > 0)
        drawn = self.rng.random() < self.rate  # drawn on every offer: the draws follow the offers, not the debt
        return drawn and self.credit_ms >= -self.cap_ms

    def take(self, cost_ms: float) -> None:
        """A paced reference predicted at ``cost_ms`` was taken: charged now, into debt if it costs more than the
        credit."""
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
        reference was charged when taken), one that is not spends the credit and the rate's share."""
        if not paced:  # at most cap_ms of debt: a long-lived tenant's warm-up does not shut the paced ones out long;
            # a deeper debt is a paced reference's charge, which this floor must not forgive
            self.credit_ms = min(self.cap_ms, max(min(self.credit_ms, -self.cap_ms), self.credit_ms - ms))
            self.unpaced_window_ms += ms
        elif self._idle_since is None:
            self.busy_credit_ms -= ms
        self.spent_ms += ms
