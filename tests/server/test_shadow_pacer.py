"""The shadow pacer: a paced namespace's shadows take a share of the live compute, pieces between decode steps only
on a short credit, and in idle time only once the engine has been idle as long as a piece takes; a namespace that is
not paced keeps its shadows as they were. Pure rules on an injected clock, then the engine worker driven turn by
turn with that clock (no thread, no timing)."""

from __future__ import annotations

import math
import random
import time

import pytest

from kvrelay.errors import ConfigError
from kvrelay.server.events import DoneEvent, ErrorEvent
from kvrelay.server.shadow import ShadowRunner, reference_ms
from kvrelay.server.shadow_pacer import (
    BUSY_WINDOW_S,
    CREDIT_WINDOW_REFS,
    CREDIT_WINDOW_S,
    RATE_WINDOW_CALLS,
    ShadowPacer,
)
from tests.server.test_quality_shadow import _drain, _job, _Rung, _SpyGuard, _worker


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def _offer(pacer: ShadowPacer, cost_ms: float) -> bool:
    """A paced call offered at its first token: taken (and charged) when drawn."""
    taken = pacer.affordable(cost_ms)
    if taken:
        pacer.take(cost_ms)
    return taken


class _FirstOnPositiveCredit(ShadowPacer):
    """The rule drawing is measured against: the first call after the credit turns positive is shadowed."""

    def affordable(self, cost_ms: float) -> bool:
        super().affordable(cost_ms)
        return self.credit_ms > 0


def _chains(pacer: ShadowPacer, num_calls: int, seed: int) -> dict[str, list[int]]:
    """Chains of three calls of one length, short and long chains in a seeded random order, a call's live time (a
    third prefill, before its offer, the rest decode) and its reference's cost proportional to its length.
    [calls, shadowed] per length."""
    rng, out = random.Random(seed), {"short": [0, 0], "long": [0, 0]}
    while sum(n for n, _ in out.values()) < num_calls:
        kind = rng.choice(("short", "long"))
        scale = 1.0 if kind == "short" else 6.0
        for _ in range(3):
            live_ms = 1000.0 * scale * rng.uniform(0.8, 1.2)
            pacer.live_turn(live_ms / 3)
            out[kind][0] += 1
            out[kind][1] += _offer(pacer, 400.0 * scale)
            pacer.live_turn(2 * live_ms / 3)
    return out


def test_long_and_short_chains_are_shadowed_at_one_rate():
    """Chains of three calls, each of one length, short and long chains at random, a long call's live time and
    reference 6x a short one's (seeded, not timed): each call is drawn at the same rate, so short and long calls are
    shadowed equally often (within 15% over 20,000 calls). The first call after the credit turns positive is more
    often a long one: a long chain holds more of the live time before the crossing (an inspection paradox)."""
    out = _chains(ShadowPacer(0.05, Clock(), seed=3), 20_000, seed=5)
    rate = {kind: shadowed / calls for kind, (calls, shadowed) in out.items()}
    assert min(rate.values()) > 0.02  # about share * mean live / mean cost = 0.125 of each
    assert 0.85 < rate["long"] / rate["short"] < 1.15
    biased = _chains(_FirstOnPositiveCredit(0.05, Clock(), seed=3), 20_000, seed=5)
    biased_rate = {kind: shadowed / calls for kind, (calls, shadowed) in biased.items()}
    assert biased_rate["long"] / biased_rate["short"] > 1.5


def test_the_shadows_take_the_share_over_a_long_run_and_the_credit_bounds_the_debt():
    """Heavy-tailed costs, references that run over or under their charge, a long-lived tenant's warm-up spending a
    third of the same share in bursts: the paced and unpaced shadows together take the share (0.9-1.05x over 60,000
    calls; were the warm-up left out of the rate, 1.2x: the credit forgives a burst past its bound), and the credit
    is never deeper than the bound past which no call is drawn and one reference."""
    rng, share = random.Random(11), 0.05
    pacer = ShadowPacer(share, Clock())
    live_ms = shadow_ms = longest_ms = 0.0
    for k in range(60_000):
        live = rng.uniform(200.0, 3000.0)
        pacer.live_turn(live)
        live_ms += live
        if k % 1000 == 999:  # a long-lived tenant's warm-up, its pieces between the paced calls
            for _ in range(30):
                pacer.spent(1000.0, paced=False)
                shadow_ms += 1000.0
        cost = min(rng.lognormvariate(6.0, 1.2), 600_000.0)  # 400 ms typical, now and then a minute and more
        bound_ms = pacer.cap_ms
        if _offer(pacer, cost):
            actual = cost * rng.uniform(0.5, 1.5)  # the cost model's error
            pacer.settle(actual - cost)
            shadow_ms += actual
            longest_ms = max(longest_ms, actual)
        assert pacer.credit_ms >= -bound_ms - longest_ms
    assert 0.9 * share <= shadow_ms / live_ms <= 1.05 * share


def test_references_dearer_than_a_minutes_share_are_drawn_at_the_rate_and_spend_the_share():
    """References of 0.7-15 s, live calls of 2-8 s (a CPU's long documents) at a 5% share: a minute's share (3 s) is
    less than one long reference. The bound is CREDIT_WINDOW_REFS mean references there, so it seldom holds a draw
    back (a bound of a minute's share would hold back a third of the calls after the long references, 0.69x the
    share) and the share is spent."""
    rng, pacer = random.Random(1), ShadowPacer(0.05, Clock())
    live_ms = shadow_ms = 0.0
    num_held = 0
    for _ in range(20_000):
        live = rng.uniform(2000.0, 8000.0)
        pacer.live_turn(live)
        live_ms += live
        cost = rng.uniform(700.0, 15_000.0)
        num_held += pacer.credit_ms < -pacer.cap_ms
        if _offer(pacer, cost):
            shadow_ms += cost
    assert pacer.cap_ms > 3 * 0.05 * CREDIT_WINDOW_S * 1e3
    assert num_held < 0.05 * 20_000
    assert 0.9 * 0.05 <= shadow_ms / live_ms <= 1.05 * 0.05


def test_the_rate_follows_the_costs_within_a_few_windows():
    """The references' cost doubles halfway through a steady stream: the rate, the same for every call, halves
    within three windows of calls and the share is spent at the new cost."""
    pacer = ShadowPacer(0.05, Clock())
    for _ in range(10 * RATE_WINDOW_CALLS):
        pacer.live_turn(1000.0)
        _offer(pacer, 100.0)
    before = pacer.rate
    assert before == pytest.approx(0.5, rel=0.01)  # 5% of a second per call, on references of 100 ms
    rates, taken = [], []
    for _ in range(10 * RATE_WINDOW_CALLS):
        pacer.live_turn(1000.0)
        taken.append(_offer(pacer, 200.0))
        rates.append(pacer.rate)
    assert rates[3 * RATE_WINDOW_CALLS] == pytest.approx(before / 2, rel=0.05)
    assert rates[RATE_WINDOW_CALLS // 4] > 0.75 * before  # a window, not the last few calls
    assert sum(taken[3 * RATE_WINDOW_CALLS:]) * 200.0 == pytest.approx(0.05 * 1000.0 * 7 * RATE_WINDOW_CALLS,
                                                                        rel=0.1)


def test_an_outlier_lowers_the_rate_by_its_part_of_the_window_and_is_drawn_at_that_rate():
    """A reference of 64 ordinary ones in a steady stream: its own offer's rate already counts it, lowered by its
    part of the window's asked cost, no more; it is drawn at that rate (over seeds), and the rate comes back as it
    leaves the window."""
    live_ms, cost_ms, outlier_ms, num_seeds = 1000.0, 150.0, 64 * 150.0, 800
    num_taken = 0
    for seed in range(num_seeds):
        pacer = ShadowPacer(0.05, Clock(), seed=seed)
        for _ in range(4 * RATE_WINDOW_CALLS):
            pacer.live_turn(live_ms)
            _offer(pacer, cost_ms)
        before = pacer.rate
        pacer.live_turn(live_ms)
        num_taken += _offer(pacer, outlier_ms)
        at_outlier = pacer.rate
        # the window asked 256 ordinary references; with the outlier, one of them is the outlier
        assert at_outlier == pytest.approx(before * (1 - (outlier_ms - cost_ms) / pacer.asked_window_ms), rel=1e-6)
        assert at_outlier < 0.85 * before
    assert abs(num_taken / num_seeds - at_outlier) < 3 * math.sqrt(at_outlier * (1 - at_outlier) / num_seeds)
    for _ in range(3 * RATE_WINDOW_CALLS):
        pacer.live_turn(live_ms)
        _offer(pacer, cost_ms)
    assert pacer.rate == pytest.approx(before, rel=0.02)


def test_the_same_seed_and_traffic_take_the_same_calls():
    def run(seed: int) -> list[bool]:
        rng, pacer = random.Random(1), ShadowPacer(0.05, Clock(), seed=seed)
        taken = []
        for _ in range(3000):
            pacer.live_turn(rng.uniform(200.0, 3000.0))
            taken.append(_offer(pacer, rng.uniform(100.0, 1000.0)))
        return taken

    assert run(7) == run(7) and sum(run(7)) > 100
    assert run(7) != run(8)
    assert ShadowPacer(0.05).rng.random() == ShadowPacer(0.05).rng.random()  # a fixed seed by default


def test_the_credit_bounds_a_run_of_lucky_draws():
    """The credit earns the share (a minute's share at most, or CREDIT_WINDOW_REFS mean references), is charged each
    reference at once and settled when it ends; past a debt as deep as that bound no call is shadowed, whatever the
    draw; a long-lived tenant's pieces spend it down to that debt, no further, and forgive no paced debt."""
    pacer = ShadowPacer(0.05, Clock())
    assert pacer.credit_ms == 0 and pacer.rate == 0 and not pacer.affordable(100.0)  # a fresh server: no live work
    pacer.live_turn(1000.0)
    assert pacer.credit_ms == pytest.approx(50.0)
    pacer.live_window_ms = 1e12  # every call drawn
    assert pacer.cap_ms == pytest.approx(0.05 * CREDIT_WINDOW_S * 1e3)
    num_taken = 0
    while pacer.affordable(1000.0):
        pacer.take(1000.0)
        num_taken += 1
    assert pacer.rate == 1.0 and pacer.credit_ms < -pacer.cap_ms <= pacer.credit_ms + 1000.0
    assert num_taken == math.ceil((50.0 + pacer.cap_ms) / 1000.0)  # 50, -950, -1950, -2950: then -3950
    assert not any(pacer.affordable(10.0) for _ in range(100))  # drawn, refused (cheap ones: the bound stays)
    pacer.settle(-2000.0)  # it ran 2 s under its charge
    assert pacer.credit_ms >= -pacer.cap_ms and pacer.affordable(10.0)
    pacer.live_turn(1e9)
    assert pacer.credit_ms == pacer.cap_ms
    pacer.asked_window_ms = RATE_WINDOW_CALLS * 60_000.0  # references of a minute each: the bound is 16 of them
    assert pacer.cap_ms == pytest.approx(CREDIT_WINDOW_REFS * 60_000.0)
    pacer.credit_ms = -30 * pacer.cap_ms
    pacer.spent(10.0, paced=False)  # a long-lived tenant's piece: its floor forgives no paced debt
    assert pacer.credit_ms == pytest.approx(-30 * pacer.cap_ms)
    pacer.credit_ms = 0.0
    pacer.spent(1e12, paced=False)
    assert pacer.credit_ms == -pacer.cap_ms and pacer.unpaced_window_ms == pytest.approx(1e12 + 10.0)


def test_a_paced_piece_between_decode_steps_needs_the_short_credit_and_one_in_idle_time_needs_idle_time():
    clock = Clock()
    pacer = ShadowPacer(0.05, clock)
    assert pacer.ready_in_s(200.0) == math.inf  # busy, nothing earned yet
    pacer.live_turn(10.0)
    assert pacer.ready_in_s(200.0) == 0.0  # the last 10 ms of live work paid for a piece to start
    credit = pacer.credit_ms
    pacer.spent(190.0, paced=True)  # a least piece between decode steps: about 3.8 s of live work to the next one
    assert pacer.credit_ms == credit  # a paced reference was charged when it was taken
    assert pacer.ready_in_s(200.0) == math.inf
    for _ in range(37):
        pacer.live_turn(100.0)
    assert pacer.ready_in_s(200.0) == math.inf
    pacer.live_turn(100.0)
    assert pacer.ready_in_s(200.0) == 0.0
    assert 0 < pacer.busy_credit_ms <= 0.05 * BUSY_WINDOW_S * 1e3
    pacer.idle()
    assert pacer.is_idle and pacer.ready_in_s(200.0) == pytest.approx(0.2)  # idle: no credit needed, idle time is
    clock.now_s += 0.15
    pacer.idle()  # a later idle turn does not restart the idle time
    assert pacer.ready_in_s(200.0) == pytest.approx(0.05)
    clock.now_s += 0.05
    assert pacer.ready_in_s(200.0) == 0.0
    busy, credit = pacer.busy_credit_ms, pacer.credit_ms
    pacer.spent(200.0, paced=True)  # an idle piece spends neither credit
    assert (pacer.busy_credit_ms, pacer.credit_ms) == (busy, credit)
    pacer.spent(300.0, paced=False)  # a piece of a shadow not paced spends the credit a paced one is taken on
    assert pacer.credit_ms == pytest.approx(credit - 300.0)
    assert pacer.spent_ms == pytest.approx(190.0 + 200.0 + 300.0)
    pacer.spent(1e9, paced=False)
    assert pacer.credit_ms == -pacer.cap_ms  # at most a window's debt
    pacer.live_turn(5.0)  # a request arrives: busy again
    assert not pacer.is_idle


@pytest.mark.parametrize("share", [0, -0.1, 1.5, float("nan"), True, "0.05"])
def test_a_share_outside_0_1_is_refused(share):
    with pytest.raises(ConfigError, match="shadow share"):
        ShadowPacer(share)


@pytest.fixture(scope="module")
def tiny():
    from kvrelay.weights.loader import load_model

    return load_model("random:tiny")


def _paced_worker(lm, clock: Clock, paced: bool = True, chunk_tokens: int = 8, paid: bool = False):
    """A worker whose shadows are paced on ``clock``; ``paid``: live work has paid for them already (``_paid``)."""
    guard = _SpyGuard({"sampled"}, _Rung("cheap", "naive"))
    guard.pace = paced
    worker = _worker(lm, guard, chunk_tokens)
    worker.shadows = ShadowRunner(worker.engine, worker.quality, pacer=ShadowPacer(0.05, clock))
    if paid:
        _paid(worker.shadows.pacer)
    return worker, guard


def _paid(pacer: ShadowPacer) -> None:
    """Live work paid for the shadows already: every paced call is drawn, on a full credit."""
    pacer.live_window_ms, pacer.credit_ms = 1e12, pacer.cap_ms


def _end(worker, *jobs) -> None:
    """Turns until every job has ended (its shadow may still be pending)."""
    while not all(j.emit.events and isinstance(j.emit.events[-1], (DoneEvent, ErrorEvent)) for j in jobs):
        worker.run_turn()


def _progress(worker) -> tuple[int, int]:
    """(chunks the first pending shadow ran, tokens it has left); (0, 0) before it began."""
    shadow = worker.shadows._pending[0]
    return (0, 0) if shadow.task is None else (shadow.task.num_chunks, shadow.task.num_remaining_tokens)


def test_an_idle_worker_waits_as_long_as_a_paced_piece_takes_before_it_starts_one(tiny):
    clock = Clock()
    worker, guard = _paced_worker(tiny, clock, paid=True)
    pacer = worker.shadows.pacer
    sampled = _job(worker, tiny.tokenizer.encode("a sampled request " * 6), "sampled", 3)
    worker.submit(sampled)
    _end(worker, sampled)
    shadow = worker.shadows._pending[0]
    assert shadow.paced and shadow.charged_ms == pytest.approx(reference_ms(len(shadow.prompt_ids),
                                                                            worker.chunk_budget))
    assert worker.shadows.num_pending == 1 and pacer.is_idle
    before = _progress(worker)
    with worker._cond:
        wait_s = worker._shadow_wait_s()
    assert wait_s is not None and wait_s > 0  # the worker's loop sleeps this long, or until a request comes
    worker._num_preparing = 1  # a request being tokenized is live work in a moment: no shadow piece starts
    with worker._cond:
        assert worker._shadow_wait_s() is None
    worker._num_preparing = 0
    for _ in range(5):  # turns in the same instant: the next call of a chain would find the engine free
        worker.run_turn()
        assert _progress(worker) == before
    clock.now_s += wait_s
    with worker._cond:
        assert worker._shadow_wait_s() == 0.0
    worker.run_turn()
    assert _progress(worker) != before
    assert shadow.task.last_piece[0] <= worker.chunk_budget.min_tokens  # a paced piece is the least the budget gives
    credit = pacer.credit_ms
    clock.now_s += 1e3  # idle for long: the shadow drains, and is settled against its charge
    _drain(worker, sampled)
    assert [(r[1], r[2]) for r in guard.records] == [("sampled", "cheap")]
    assert pacer.credit_ms == pytest.approx(credit - (shadow.spent_ms - shadow.charged_ms))
    worker.stop()


def test_without_credit_a_paced_call_is_not_shadowed_and_decode_turns_run_no_paced_piece(tiny):
    clock = Clock()
    worker, guard = _paced_worker(tiny, clock, paid=True)
    pacer = worker.shadows.pacer
    first = _job(worker, tiny.tokenizer.encode("the first sampled call " * 4), "sampled", 30)
    worker.submit(first)
    while first.seq is None:
        worker.run_turn()
    assert worker.shadows.num_pending == 1  # drawn, on the credit
    pacer.busy_credit_ms = -1e6  # pieces between decode steps have had their share
    before = _progress(worker)
    for _ in range(10):  # decode turns of the first call: live work, no short credit, no shadow piece
        worker.run_turn()
        assert _progress(worker) == before
    pacer.credit_ms = -1e6  # and the share is spent
    second = _job(worker, tiny.tokenizer.encode("a second sampled call " * 4), "sampled", 3)
    worker.submit(second)
    while second.seq is None:
        worker.run_turn()
    assert worker.shadows.num_pending == 1  # the second call was drawn but not shadowed: the debt is too deep
    assert _progress(worker) == before
    _end(worker, first, second)
    clock.now_s += 1e3
    _drain(worker, first, second)  # once idle, the shadow taken runs on without credit
    assert len(guard.records) == 1
    worker.stop()


def test_the_worker_offers_a_paced_call_with_its_references_predicted_cost(tiny):
    """The worker hands the pacer the call's reference as the chunk budget predicts it, before the draw (the rate
    counts it), and charges that when it is taken."""
    worker, _ = _paced_worker(tiny, Clock())
    pacer = worker.shadows.pacer
    asked = []
    pacer.affordable = lambda cost_ms: asked.append(cost_ms) or True
    job = _job(worker, tiny.tokenizer.encode("a sampled request " * 6), "sampled", 3)
    worker.submit(job)
    _end(worker, job)
    predicted = reference_ms(len(job.seq.prompt_ids), worker.chunk_budget)
    assert asked == [pytest.approx(predicted)] and predicted > 0
    assert worker.shadows._pending[0].charged_ms == pytest.approx(predicted)
    worker.stop()


def test_a_namespace_that_is_not_paced_keeps_its_shadows_between_decode_steps_on_no_credit(tiny, monkeypatch):
    """A long-lived tenant's warm-up is not held to the share: its shadow runs in decode turns with every credit
    spent, a piece each of no more than the least piece (as any shadow beside a decode step:
    test_shadow_beside_decode), and what it takes is spent from the credit a paced tenant is shadowed on."""
    clock = Clock()
    worker, guard = _paced_worker(tiny, clock, paced=False)
    budget = worker.chunk_budget
    # the budget keeps its prior (a token costs the same at every position): the live pieces, timed on the wall
    # clock, do not refit it, so its pieces do not shrink on a loaded machine
    monkeypatch.setattr(budget, "observe", lambda piece: None)
    pacer = worker.shadows.pacer
    # a bound of months (references asked of a month each) and half of it in debt: neither the live turns' earnings
    # (a share of their wall-clock time) nor the pieces' spending reaches an end of it, however loaded the machine
    pacer.asked_window_ms = RATE_WINDOW_CALLS * 30 * 86_400e3
    pacer.credit_ms = pacer.busy_credit_ms = -pacer.cap_ms / 2
    pieces = []  # (ms, paced, the credit before, after) of each shadow piece, as the pacer was told it
    spent = pacer.spent

    def spy(ms: float, paced: bool) -> None:
        before = pacer.credit_ms
        spent(ms, paced)
        pieces.append((ms, paced, before, pacer.credit_ms))

    pacer.spent = spy
    job = _job(worker, tiny.tokenizer.encode("a long-lived role's call " * 4), "sampled", 30)
    worker.submit(job)
    while job.seq is None:
        worker.run_turn()
    shadow = worker.shadows._pending[0]
    assert not shadow.paced and shadow.charged_ms == 0
    for _ in range(3):
        num_left, num_pieces = shadow.task.num_remaining_tokens, len(pieces)
        worker.run_turn()
        assert shadow.task.last_piece[0] <= min(budget.min_tokens, num_left) and len(pieces) == num_pieces + 1
    assert budget.max_tokens > budget.min_tokens  # the least piece, not a turn's budget
    for ms, paced, before, after in pieces:  # on no credit, and its time spent from the credit
        assert not paced and ms > 0 and before < 0 and after == before - ms
    _drain(worker, job)  # no clock moves: it needs no idle time either
    assert len(guard.records) == 1
    worker.stop()


def test_two_shadows_of_one_prompt_and_a_stream_beside_them_all_end_well(tiny):
    """A client that sends the same prompt twice (a retry, n samples as n requests): two paced shadows of equal
    fields are two shadows, and the live stream running beside them is never failed by them."""
    clock = Clock()
    worker, guard = _paced_worker(tiny, clock, paid=True)
    pacer = worker.shadows.pacer
    twins = [_job(worker, tiny.tokenizer.encode("the same question twice " * 3), "sampled", 2) for _ in range(2)]
    for job in twins:
        worker.submit(job)
    _end(worker, *twins)
    assert worker.shadows.num_pending == 2
    stream = _job(worker, tiny.tokenizer.encode("an unrelated long answer"), "other", 40)
    worker.submit(stream)
    while stream.seq is None:
        worker.run_turn()
    for _ in range(20):  # pieces between the stream's decode steps, on a short credit each turn
        pacer.busy_credit_ms = 1.0
        worker.run_turn()
    _end(worker, stream)
    clock.now_s += 1e3  # the idle grace over
    _drain(worker, stream, *twins)
    assert isinstance(stream.emit.events[-1], DoneEvent)
    assert len(guard.records) == 2
    worker.stop()


def test_a_worker_thread_wakes_after_the_idle_grace_with_no_request_to_wake_it(tiny):
    """The worker's loop sleeps out a paced piece's idle grace on its own (a timed wait), then runs the shadow: no
    later request is needed to drain it. Bounded: the test waits for events, at most 60 s."""
    worker, guard = _paced_worker(tiny, time.perf_counter, paid=True)
    job = _job(worker, tiny.tokenizer.encode("a sampled call on a live worker " * 3), "sampled", 3)
    worker.start()
    try:
        worker.submit(job)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (guard.records and worker.shadows.num_pending == 0):
            time.sleep(0.01)
        assert len(guard.records) == 1 and worker.shadows.num_pending == 0
        assert isinstance(job.emit.events[-1], DoneEvent)
    finally:
        worker.stop()
