"""The shadow pacer: a paced namespace's shadows take a share of the live compute, pieces between decode steps only
on a short credit, and in idle time only once the engine has been idle as long as a piece takes; a namespace that is
not paced keeps its shadows as they were. Pure rules on an injected clock, then the engine worker driven turn by
turn with that clock (no thread, no timing)."""

from __future__ import annotations

import math
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


def test_a_reference_is_taken_when_live_work_has_paid_for_it_and_charged_at_once():
    pacer = ShadowPacer(0.05, Clock())
    assert pacer.credit_ms == 0 and not pacer.affordable(1.0)  # a fresh server has no credit
    pacer.live_turn(1000.0)
    assert pacer.credit_ms == pytest.approx(50.0)
    assert not pacer.affordable(60.0) and pacer.affordable(50.0)
    pacer.take(50.0)
    assert pacer.credit_ms == pytest.approx(0.0) and not pacer.affordable(50.0)  # no second one on the same credit
    pacer.settle(-20.0)  # it ran 20 ms under its charge
    assert pacer.credit_ms == pytest.approx(20.0)
    pacer.live_turn(CREDIT_WINDOW_S * 1e3 * 10)
    assert pacer.credit_ms == pytest.approx(0.05 * CREDIT_WINDOW_S * 1e3)  # a minute's share at most
    big_ms = pacer.cap_ms * 2  # a reference dearer than the window's share: the credit may grow to it
    assert not pacer.affordable(big_ms)
    pacer.live_turn(CREDIT_WINDOW_S * 1e3 * 10)
    assert pacer.affordable(big_ms)


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
