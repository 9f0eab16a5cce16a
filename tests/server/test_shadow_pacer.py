"""The shadow pacer: shadows take a share of the live compute, pieces between decode steps only on credit, and in
idle time only once the engine has been idle as long as a piece takes. Pure rules on an injected clock, then the
engine worker driven turn by turn with that clock (no thread, no timing)."""

from __future__ import annotations

import math

import pytest

from kvrelay.errors import ConfigError
from kvrelay.server.events import DoneEvent, ErrorEvent
from kvrelay.server.shadow import ShadowRunner
from kvrelay.server.shadow_pacer import BUSY_WINDOW_S, CREDIT_WINDOW_S, ShadowPacer
from tests.server.test_quality_shadow import _drain, _job, _Rung, _SpyGuard, _worker


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_credit_is_earned_by_live_work_spent_by_shadows_and_capped_at_the_window():
    clock = Clock()
    pacer = ShadowPacer(0.05, clock)
    assert pacer.credit_ms == pacer.cap_ms == pytest.approx(0.05 * CREDIT_WINDOW_S * 1e3)  # a fresh server
    pacer.live_turn(1000.0)
    assert pacer.credit_ms == pytest.approx(pacer.cap_ms)  # never over the window's share
    pacer.spent(pacer.cap_ms + 30.0)
    assert not pacer.affordable and pacer.credit_ms == pytest.approx(-30.0)
    pacer.live_turn(400.0)  # 20 ms of credit: still short
    assert not pacer.affordable
    pacer.live_turn(300.0)
    assert pacer.affordable and pacer.credit_ms == pytest.approx(5.0)
    assert pacer.spent_ms == pytest.approx(pacer.cap_ms + 30.0)


def test_a_piece_between_decode_steps_needs_both_credits_and_one_in_idle_time_needs_idle_time():
    clock = Clock()
    pacer = ShadowPacer(0.05, clock)
    assert pacer.ready_in_s(200.0) == math.inf  # busy on a fresh server: the long credit is there, the short is not
    pacer.live_turn(10.0)
    assert pacer.ready_in_s(200.0) == 0.0  # the last 10 ms of live work paid for a piece to start
    pacer.spent(190.0)  # a least piece between decode steps: about 3.8 s of live work before the next one
    assert pacer.credit_ms > 0 and pacer.ready_in_s(200.0) == math.inf
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
    busy_before = pacer.busy_credit_ms
    pacer.spent(pacer.credit_ms + 10.0)  # an idle piece spends the long credit only
    assert pacer.busy_credit_ms == busy_before and pacer.ready_in_s(200.0) == 0.0  # idle pieces need none
    pacer.live_turn(5.0)  # a request arrives: busy again, out of the long credit
    assert not pacer.is_idle and pacer.ready_in_s(200.0) == math.inf


@pytest.mark.parametrize("share", [0, -0.1, 1.5, float("nan"), True, "0.05"])
def test_a_share_outside_0_1_is_refused(share):
    with pytest.raises(ConfigError, match="shadow share"):
        ShadowPacer(share)


@pytest.fixture(scope="module")
def tiny():
    from kvrelay.weights.loader import load_model

    return load_model("random:tiny")


def _paced_worker(lm, sampled_roles: set[str], clock: Clock, chunk_tokens: int = 8):
    guard = _SpyGuard(sampled_roles, _Rung("cheap", "naive"))
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


def test_an_idle_worker_waits_as_long_as_a_piece_takes_before_it_starts_one(tiny):
    clock = Clock()
    worker, guard = _paced_worker(tiny, {"sampled"}, clock)
    sampled = _job(worker, tiny.tokenizer.encode("a sampled request " * 6), "sampled", 3)
    worker.submit(sampled)
    _end(worker, sampled)
    assert worker.shadows.num_pending == 1 and worker.shadows.pacer.is_idle
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
    num_chunks = _progress(worker)[0]
    least = worker.chunk_budget.min_tokens
    assert worker.shadows._pending[0].task.last_piece[0] <= least  # a paced piece is the least the budget gives
    clock.now_s += 1e3  # idle for long: the shadow drains without any credit
    worker.shadows.pacer.spent(worker.shadows.pacer.cap_ms * 10)
    _drain(worker, sampled)
    assert [(r[1], r[2]) for r in guard.records] == [("sampled", "cheap")]
    assert num_chunks >= 1
    worker.stop()


def test_without_credit_a_call_is_not_shadowed_and_decode_turns_run_no_shadow_piece(tiny):
    clock = Clock()
    worker, guard = _paced_worker(tiny, {"sampled"}, clock)
    pacer = worker.shadows.pacer
    first = _job(worker, tiny.tokenizer.encode("the first sampled call " * 4), "sampled", 30)
    worker.submit(first)
    while first.seq is None:
        worker.run_turn()
    assert worker.shadows.num_pending == 1  # taken on the fresh server's credit
    pacer.spent(pacer.credit_ms + 1e6)  # the share is spent
    before = _progress(worker)
    for _ in range(10):  # decode turns of the first call: live work, no credit, no shadow piece
        worker.run_turn()
        assert _progress(worker) == before
    second = _job(worker, tiny.tokenizer.encode("a second sampled call " * 4), "sampled", 3)
    worker.submit(second)
    while second.seq is None:
        worker.run_turn()
    assert worker.shadows.num_pending == 1  # the second call was sampled but not shadowed: no credit
    assert _progress(worker) == before
    _end(worker, first, second)
    clock.now_s += 1e3
    _drain(worker, first, second)  # once idle, the shadow taken runs on without credit
    assert len(guard.records) == 1 and pacer.credit_ms < 0
    worker.stop()
