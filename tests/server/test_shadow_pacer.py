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
from kvrelay.server.shadow_pacer import BUSY_WINDOW_S, CREDIT_WINDOW_S, ShadowPacer
from tests.server.test_quality_shadow import _drain, _job, _Rung, _SpyGuard, _worker


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_a_reference_is_taken_on_a_positive_credit_and_charged_at_once_into_debt():
    pacer = ShadowPacer(0.05, Clock())
    assert pacer.credit_ms == 0 and not pacer.affordable()  # a fresh server has no credit
    pacer.live_turn(1000.0)
    assert pacer.credit_ms == pytest.approx(50.0) and pacer.affordable()
    pacer.take(200.0)  # dearer than the credit: taken all the same, the rest is a debt
    assert pacer.credit_ms == pytest.approx(-150.0) and not pacer.affordable()  # no second one until it is repaid
    pacer.live_turn(3000.0)
    assert pacer.credit_ms == pytest.approx(0.0) and not pacer.affordable()
    pacer.settle(-20.0)  # it ran 20 ms under its charge
    assert pacer.credit_ms == pytest.approx(20.0) and pacer.affordable()
    pacer.live_turn(CREDIT_WINDOW_S * 1e3 * 10)
    assert pacer.credit_ms == pytest.approx(0.05 * CREDIT_WINDOW_S * 1e3) == pacer.cap_ms  # a minute's share at most
    big_ms = pacer.cap_ms * 20  # a reference dearer than the window's share needs no more than a positive credit
    assert pacer.affordable()
    pacer.take(big_ms)
    assert pacer.credit_ms == pytest.approx(-19 * pacer.cap_ms)
    pacer.spent(10.0, paced=False)  # a long-lived tenant's piece: its floor (a window's debt) forgives no paced debt
    assert pacer.credit_ms == pytest.approx(-19 * pacer.cap_ms)


def _replay(pacer: ShadowPacer, calls) -> list[bool]:
    """Each call (live_ms, cost_ms): its live work, then offered at its first token (taken when affordable), its
    reference as long as predicted. Whether each was shadowed."""
    taken = []
    for live_ms, cost_ms in calls:
        pacer.live_turn(live_ms)
        taken.append(pacer.affordable())
        if taken[-1]:
            pacer.take(cost_ms)
    return taken


SHORT_MS, LONG_MS = 600.0, 4000.0  # a long reference dearer than the window's credit (3 s at a 5% share)


def test_a_steady_mix_of_short_and_long_calls_has_its_long_ones_shadowed_as_often_as_its_short_ones():
    """Short and long calls alternate, each with live time of the same spread (seeded, not timed): a rule that asks
    the credit to cover the call's own cost spends it on the short ones; here the long ones are shadowed about as
    often, so the guard's sample of the tenant is not the short prompts'. Not exactly as often: a short reference's
    debt is repaid in a few calls, and with the lengths strictly alternating, the parity of that count favours one
    kind (0.86-1.06 long per short over seeds here; 0.8 with short debts of two calls)."""
    rng = random.Random(7)
    calls = [(rng.uniform(500.0, 1500.0), LONG_MS if k % 2 else SHORT_MS) for k in range(40_000)]
    taken = _replay(ShadowPacer(0.05, Clock()), calls)
    num_short = sum(t for t, c in zip(taken, calls, strict=True) if c[1] == SHORT_MS)
    num_long = sum(t for t, c in zip(taken, calls, strict=True) if c[1] == LONG_MS)
    assert num_long > 200  # long references every few minutes of live work, not never
    assert 0.8 < num_long / num_short < 1.25
    # the share pays for the mix's mean cost: about share * live / mean cost references
    expected = 0.05 * sum(c[0] for c in calls) / ((SHORT_MS + LONG_MS) / 2)
    assert 0.9 * expected < num_short + num_long < 1.1 * expected


def test_a_calls_own_prefill_does_not_earn_the_credit_it_is_shadowed_on():
    """One client, random short and long calls, a long call's prefill 20x a short one's (seeded, not timed): were
    its own prefill's earning counted, the credit would turn positive during the long calls' prefills and they would
    be shadowed several times as often as the short ones (3.5-3.9x here); without it, about as often."""
    rng, pacer = random.Random(7), ShadowPacer(0.05, clock=lambda: 0.0)
    num_calls, num_taken = {"short": 0, "long": 0}, {"short": 0, "long": 0}
    for _ in range(20000):
        kind = rng.choice(("short", "long"))
        prefill_ms = (300.0 if kind == "short" else 6000.0) * rng.uniform(0.8, 1.2)
        pacer.live_turn(prefill_ms)
        num_calls[kind] += 1
        if pacer.affordable(prefill_ms):
            pacer.take(600.0 if kind == "short" else 6000.0)
            num_taken[kind] += 1
        pacer.live_turn(1500.0 * rng.uniform(0.5, 1.5))  # its decode
    rate = {kind: num_taken[kind] / num_calls[kind] for kind in num_calls}
    assert min(rate.values()) > 0
    assert 0.85 < rate["long"] / rate["short"] < 1.15


def test_an_outlier_is_shadowed_like_any_call_and_holds_the_sampling_back_only_for_its_own_cost():
    """A huge prompt now and then (a reference of 20 minutes' share): refused while the credit is spent, it changes
    nothing for the calls after it; taken on a positive credit, the next reference waits exactly for the live work
    that repays its cost."""
    share, live_ms, outlier_ms = 0.05, 1000.0, 60_000.0
    steady = [(live_ms, SHORT_MS)] * 100
    with_outlier = steady[:10] + [(live_ms, outlier_ms)] + steady[11:]
    plain = _replay(ShadowPacer(share, Clock()), steady)
    assert not plain[10]  # the outlier's turn falls on a debt: refused, as the short call there was
    assert _replay(ShadowPacer(share, Clock()), with_outlier) == plain  # and the calls after it see no difference
    pacer = ShadowPacer(share, Clock())
    first = _replay(pacer, [(live_ms, outlier_ms)])  # the first call on a fresh server is the outlier
    after = _replay(pacer, [(live_ms, SHORT_MS)] * 2000)
    assert first == [True]
    num_repay = math.ceil((outlier_ms - share * live_ms) / (share * live_ms))  # calls whose live work repays it
    assert after.index(True) == num_repay  # the call right after the debt is repaid, no later
    assert sum(after) == pytest.approx((2000 - num_repay) * share * live_ms / SHORT_MS, abs=1)  # then as before


def test_the_paced_shadows_take_at_most_the_share_plus_a_window_and_one_reference_over_a_long_run():
    """Heavy-tailed costs, references that run over or under their charge, a long-lived tenant's pieces spending
    the same credit: at every call the paced references' time stays under ``share`` of the live time plus the
    window's credit and the longest reference, and over the run it comes close to the share."""
    rng = random.Random(11)
    share = 0.05
    pacer = ShadowPacer(share, Clock())
    live_ms = paced_ms = longest_ms = 0.0
    for k in range(60_000):
        live = rng.uniform(200.0, 3000.0)
        pacer.live_turn(live)
        live_ms += live
        if k % 5000 == 4999:  # a long-lived tenant's warm-up: its pieces spend the credit, down to a window's debt
            for _ in range(20):
                pacer.spent(1000.0, paced=False)
        if pacer.affordable():
            cost = min(rng.lognormvariate(6.0, 1.2), 600_000.0)  # 400 ms typical, now and then a minute and more
            actual = cost * rng.uniform(0.6, 1.6)  # the cost model's error, a little over on average
            pacer.take(cost)
            pacer.settle(actual - cost)
            paced_ms += actual
            longest_ms = max(longest_ms, actual)
        assert paced_ms <= share * live_ms + pacer.cap_ms + longest_ms
    assert 0.9 * share < paced_ms / live_ms <= share


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


def _paced_worker(lm, clock: Clock, paced: bool = True, chunk_tokens: int = 8):
    guard = _SpyGuard({"sampled"}, _Rung("cheap", "naive"))
    guard.pace = paced
    worker = _worker(lm, guard, chunk_tokens)
    worker.shadows = ShadowRunner(worker.engine, worker.quality, pacer=ShadowPacer(0.05, clock))
    return worker, guard


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
    worker, guard = _paced_worker(tiny, clock)
    pacer = worker.shadows.pacer
    pacer.credit_ms = pacer.cap_ms  # live work paid for it already
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
    worker, guard = _paced_worker(tiny, clock)
    pacer = worker.shadows.pacer
    pacer.credit_ms = pacer.cap_ms
    first = _job(worker, tiny.tokenizer.encode("the first sampled call " * 4), "sampled", 30)
    worker.submit(first)
    while first.seq is None:
        worker.run_turn()
    assert worker.shadows.num_pending == 1  # taken on the credit
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
    assert worker.shadows.num_pending == 1  # the second call was sampled but not shadowed: no credit
    assert _progress(worker) == before
    _end(worker, first, second)
    clock.now_s += 1e3
    _drain(worker, first, second)  # once idle, the shadow taken runs on without credit
    assert len(guard.records) == 1
    worker.stop()


def test_the_worker_asks_the_credit_without_what_the_calls_own_prefill_earned(tiny):
    """The worker hands the pacer the call's own prefill time (its engine work, measured), so that a long prefill
    does not earn the credit its own reference is taken on."""
    worker, _ = _paced_worker(tiny, Clock())
    pacer = worker.shadows.pacer
    asked = []
    pacer.affordable = lambda prefill_ms=0.0: asked.append(prefill_ms) or True
    job = _job(worker, tiny.tokenizer.encode("a sampled request " * 6), "sampled", 3)
    worker.submit(job)
    _end(worker, job)
    assert asked == [job.prefill_compute_ms] and job.prefill_compute_ms > 0
    worker.stop()


def test_a_namespace_that_is_not_paced_keeps_its_shadows_between_decode_steps_on_no_credit(tiny):
    """A long-lived tenant's warm-up is not held to the share: its shadow runs in decode turns with every credit
    spent, a turn's budget a piece, and what it takes is spent from the credit a paced tenant is shadowed on."""
    clock = Clock()
    worker, guard = _paced_worker(tiny, clock, paced=False)
    pacer = worker.shadows.pacer
    pacer.credit_ms = pacer.busy_credit_ms = -1.0
    job = _job(worker, tiny.tokenizer.encode("a long-lived role's call " * 4), "sampled", 30)
    worker.submit(job)
    while job.seq is None:
        worker.run_turn()
    shadow = worker.shadows._pending[0]
    assert not shadow.paced and shadow.charged_ms == 0
    for _ in range(3):
        worker.run_turn()
    assert shadow.task is not None and shadow.task.last_piece[0] > worker.chunk_budget.min_tokens
    assert pacer.credit_ms < -1.0  # its pieces' time
    _drain(worker, job)  # no clock moves: it needs no idle time either
    assert len(guard.records) == 1
    worker.stop()


def test_two_shadows_of_one_prompt_and_a_stream_beside_them_all_end_well(tiny):
    """A client that sends the same prompt twice (a retry, n samples as n requests): two paced shadows of equal
    fields are two shadows, and the live stream running beside them is never failed by them."""
    clock = Clock()
    worker, guard = _paced_worker(tiny, clock)
    pacer = worker.shadows.pacer
    pacer.credit_ms = pacer.cap_ms
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
    worker, guard = _paced_worker(tiny, time.perf_counter)
    pacer = worker.shadows.pacer
    pacer.credit_ms = pacer.cap_ms
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
