"""Per-request metrics (kvrelay.server.request_metrics) read from a fresh registry per worker, on a fake clock: the
worker is driven turn by turn and the clock set before each turn, so every latency has a known value."""

from __future__ import annotations

import threading

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine
from kvrelay.server.catalog import SpanCatalog
from kvrelay.server.events import DoneEvent, ErrorEvent, Event
from kvrelay.server.metrics import ServerMetrics
from kvrelay.server.prompting import PromptBuild
from kvrelay.server.protocol import ApiError
from kvrelay.server.request_metrics import FINISH_REASONS
from kvrelay.server.scheduler import EngineWorker, Job
from kvrelay.weights.loader import load_model


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Events(list):
    def __init__(self) -> None:
        super().__init__()
        self.ended = threading.Event()

    def __call__(self, event: Event) -> None:
        self.append(event)
        if isinstance(event, (DoneEvent, ErrorEvent)):
            self.ended.set()


@pytest.fixture(scope="module")
def tiny():
    return load_model("random:tiny")


def _worker(lm, chunk_tokens: int = 64) -> tuple[EngineWorker, _Clock]:
    store = KVStore(1 << 28)
    worker = EngineWorker(Engine(lm, store), SpanCatalog(store, lm.fingerprint), ServerMetrics(),
                          prefill_chunk_tokens=chunk_tokens)
    clock = worker.requests.clock = _Clock()
    return worker, clock


def _job(build, max_tokens: int) -> Job:
    job = Job(build, "ns", "full", max_tokens, max_tokens, 0.0, 1.0, 0, [], None, False, _Events())
    job.created_s = 0.0  # arrival on the fake clock
    return job


def _value(worker: EngineWorker, name: str, **labels: str) -> float:
    value = worker.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_one_request_s_latencies_sizes_and_ending_are_the_values_of_its_turns(tiny):
    """A prompt prefilled in several pieces, then decoded: each turn runs at a clock time of its own, and every
    histogram holds exactly what that request's turns say (queue, prefill, TTFT, decode, e2e, per-token times)."""
    worker, clock = _worker(tiny)
    ids = tiny.tokenizer.encode("word " * 200)
    job = _job(lambda: (PromptBuild(ids, []), "agent"), 6)
    worker.prepare(job)
    worker.submit(job)
    times, first_s = [], None
    while not job.emit.ended.is_set():
        clock.now = 1.5 + 2.0 * len(times) + 0.25 * len(times) ** 2  # a distinct gap before every turn
        times.append(clock.now)
        worker.run_turn()
        if first_s is None and job.seq is not None:
            first_s = clock.now
    worker.stop()
    done = job.emit[-1]
    assert isinstance(done, DoneEvent) and done.finish_reason == "length"
    assert first_s is not None and first_s > times[0]  # the prefill took more than one turn
    last_s, num = times[-1], done.num_completion_tokens
    assert num == 6 and done.num_prompt_tokens == len(ids)
    expected = {"kvrelay_request_queue_time_seconds": times[0], "kvrelay_request_prefill_time_seconds":
                first_s - times[0], "kvrelay_ttft_seconds": first_s, "kvrelay_request_decode_time_seconds":
                last_s - first_s, "kvrelay_e2e_request_latency_seconds": last_s,
                "kvrelay_request_time_per_output_token_seconds": (last_s - first_s) / (num - 1),
                "kvrelay_request_prompt_tokens": len(ids), "kvrelay_request_generation_tokens": num,
                "kvrelay_request_reused_prompt_ratio": 0.0}
    for name, value in expected.items():
        assert _value(worker, name + "_count") == 1, name
        assert _value(worker, name + "_sum") == pytest.approx(value), name
    # one inter-token time per token after the first; they add up to the decode time
    assert _value(worker, "kvrelay_inter_token_latency_seconds_count") == num - 1
    assert _value(worker, "kvrelay_inter_token_latency_seconds_sum") == pytest.approx(last_s - first_s)
    assert _value(worker, "kvrelay_request_reused_prompt_ratio_bucket", le="0.0") == 1  # full reuses nothing
    assert _value(worker, "kvrelay_prompt_tokens_total") == len(ids)
    assert _value(worker, "kvrelay_reused_prompt_tokens_total") == 0
    assert {r: _value(worker, "kvrelay_requests_finished_total", finish_reason=r)
            for r in FINISH_REASONS} == {
        "stop": 0, "length": 1, "tool_calls": 0, "cancelled": 0, "rejected": 0, "shutdown": 0, "error": 0}


def test_a_reused_prompt_s_share_is_its_cached_tokens_over_its_prompt(tiny):
    """The second request repeats the first one's prompt: its cached tokens (what its client reads in usage) over its
    prompt tokens is the ratio observed, and the reuse counters add them up."""
    worker, _ = _worker(tiny)
    ids = tiny.tokenizer.encode("a shared system prompt that every agent repeats word for word " * 4)
    events = []
    for method in ("full", "prefix"):
        job = _job(lambda: (PromptBuild(ids, []), "agent"), 2)
        job.method = method
        worker.prepare(job)
        worker.submit(job)
        while not job.emit.ended.is_set():
            worker.run_turn()
        events.append(job.emit[-1])
    worker.stop()
    second = events[1]
    assert 0 < second.num_cached_tokens < second.num_prompt_tokens
    ratio = second.num_cached_tokens / second.num_prompt_tokens
    assert _value(worker, "kvrelay_request_reused_prompt_ratio_sum") == pytest.approx(ratio)
    assert _value(worker, "kvrelay_request_reused_prompt_ratio_count") == 2
    assert _value(worker, "kvrelay_reused_prompt_tokens_total") == second.num_cached_tokens
    assert _value(worker, "kvrelay_prompt_tokens_total") == 2 * len(ids)


def test_requests_that_end_early_are_counted_by_how_they_ended(tiny):
    """A request cancelled before its prompt was prepared (its client gone while it waited for a prepare thread:
    counted nowhere before), one cancelled in the queue, and one whose prompt the worker refuses (a 400: rejected,
    not an error of the server's)."""
    worker, _ = _worker(tiny)
    ids = tiny.tokenizer.encode("a prompt")
    gone_early = _job(lambda: (PromptBuild(ids, []), "agent"), 2)
    gone_early.cancel()
    worker.submit(gone_early)  # unprepared: to the prepare threads, which see it cancelled
    queued = _job(lambda: (PromptBuild(ids, []), "agent"), 2)
    worker.prepare(queued)
    worker.submit(queued)
    worker.cancel(queued)

    def refused():
        raise ApiError(400, "planted: a prompt the worker refuses", code="invalid_value")

    bad = _job(refused, 2)
    worker.submit(bad)
    assert bad.emit.ended.wait(30)
    with worker._cond:  # the prepare threads are done with both unprepared jobs
        while worker._num_preparing:
            worker._cond.wait(30)
    worker.stop()
    assert isinstance(bad.emit[-1], ErrorEvent) and not gone_early.emit and not queued.emit
    assert _value(worker, "kvrelay_requests_finished_total", finish_reason="cancelled") == 2
    assert _value(worker, "kvrelay_cancelled_total") == 2
    assert _value(worker, "kvrelay_requests_finished_total", finish_reason="rejected") == 1
    assert _value(worker, "kvrelay_requests_finished_total", finish_reason="error") == 0
    assert _value(worker, "kvrelay_e2e_request_latency_seconds_count") == 0  # none of them was served


def test_the_page_has_no_created_series_and_other_registries_keep_theirs():
    """``*_created`` (one per counter and histogram series) is left off this server's page, and only there."""
    metrics = ServerMetrics()
    metrics.requests.labels("chat").inc()
    page = metrics.render().decode()
    assert 'kvrelay_requests_total{endpoint="chat"} 1.0' in page and "kvrelay_ttft_seconds_count" in page
    assert "_created" not in page
    other = CollectorRegistry()
    Counter("other_things", "an embedding application's counter", registry=other).inc()
    assert b"other_things_created" in generate_latest(other)
