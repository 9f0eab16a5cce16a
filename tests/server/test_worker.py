"""The engine worker in process: a request that breaks while it is started fails alone."""

from __future__ import annotations

import threading

import pytest

from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine
from kvrelay.engine.prefill import PrefillTask
from kvrelay.server import scheduler
from kvrelay.server.catalog import SpanCatalog
from kvrelay.server.events import DoneEvent, ErrorEvent, Event
from kvrelay.server.metrics import ServerMetrics
from kvrelay.server.prompting import PromptBuild
from kvrelay.server.scheduler import EngineWorker, Job
from kvrelay.weights.loader import load_model

PLANTED = "planted: a bug met while starting this request"
GOOD_TOKENS = 200


class _Events:
    def __init__(self, other: _Events | None = None) -> None:
        self.events: list[Event] = []
        self.ended, self.first = threading.Event(), threading.Event()
        self.other = other  # whose state to note when this one ends
        self.other_ended_first: bool | None = None

    def __call__(self, event: Event) -> None:
        self.events.append(event)
        self.first.set()
        if isinstance(event, (DoneEvent, ErrorEvent)):
            if self.other is not None:
                self.other_ended_first = self.other.ended.is_set()
            self.ended.set()


def _job(build, emit, max_tokens: int, stop: list[str]) -> Job:
    return Job(build, "ns", "full", max_tokens, max_tokens, 0.0, 1.0, 0, stop, None, False, emit)


class _BrokenMatcher(scheduler.StopMatcher):
    def __init__(self, stops: list[str], *args) -> None:
        if "PLANT" in stops:
            raise RuntimeError(PLANTED)
        super().__init__(stops, *args)


def _broken_build():
    raise RuntimeError(PLANTED)


@pytest.mark.parametrize("where", ["admission", "start"])
def test_a_request_that_breaks_while_it_is_started_fails_alone(monkeypatch, where):
    monkeypatch.setattr(scheduler, "StopMatcher", _BrokenMatcher)
    lm = load_model("random:tiny")
    store = KVStore(1 << 28)
    worker = EngineWorker(Engine(lm, store), SpanCatalog(store, lm.fingerprint), ServerMetrics())
    ids = lm.tokenizer.encode("a prompt that decodes for a while")
    good = _Events()
    bad = _Events(other=good)
    build = (lambda: (PromptBuild(ids, []), "agent")) if where == "start" else _broken_build

    worker.start()
    try:
        worker.submit(_job(lambda: (PromptBuild(ids, []), "agent"), good, GOOD_TOKENS, []))
        assert good.first.wait(30)  # admitted: its first token is out, it is running
        worker.submit(_job(build, bad, 4, ["PLANT"]))
        assert bad.ended.wait(30) and good.ended.wait(60)
    finally:
        worker.stop()
    assert bad.other_ended_first is False  # the good request was still running when the bad one failed
    assert isinstance(bad.events[-1], ErrorEvent) and bad.events[-1].status == 500
    assert bad.events[-1].code == "internal_error" and PLANTED not in bad.events[-1].message
    assert isinstance(good.events[-1], DoneEvent) and good.events[-1].num_completion_tokens == GOOD_TOKENS
    assert worker.num_running == 0
    assert worker.metrics.registry.get_sample_value("kvrelay_sequence_kv_bytes") == 0  # the failed one's KV too


def _prepared(worker: EngineWorker, ids: list[int], emit, max_tokens: int, method: str = "full") -> Job:
    job = Job(lambda: (PromptBuild(ids, []), "agent"), "ns", method, max_tokens, max_tokens, 0.0, 1.0, 0, [], None,
              False, emit)
    worker.prepare(job)  # what the server's prepare threads do before the queue
    return job


@pytest.fixture(scope="module")
def tiny():
    return load_model("random:tiny")


def _worker(lm, chunk_tokens: int) -> EngineWorker:
    store = KVStore(1 << 28)
    return EngineWorker(Engine(lm, store), SpanCatalog(store, lm.fingerprint), ServerMetrics(),
                        prefill_chunk_tokens=chunk_tokens)


@pytest.mark.parametrize("method", ["full", "epic"])
def test_a_long_prompt_prefills_in_chunks_while_the_running_request_decodes_every_turn(tiny, method):
    """Driven turn by turn (no thread, no timing): while a long prompt prefills, the running request gets one
    token per turn, and a short request sent meanwhile is prefilled in its first turn, ahead of the long one."""
    chunk = 64
    worker = _worker(tiny, chunk)
    running = _prepared(worker, tiny.tokenizer.encode("a prompt that decodes for a while"), _Events(), 200, method)
    worker.submit(running)
    worker.run_turn()
    assert running.seq is not None and worker.num_running == 1
    long_ids = tiny.tokenizer.encode("word " * 600)
    long = _prepared(worker, long_ids, _Events(), 4, method)
    worker.submit(long)
    num_turns = 0
    short = None
    while long.seq is None:
        before = len(running.seq.output_ids)
        worker.run_turn()
        num_turns += 1
        assert len(running.seq.output_ids) == before + 1  # a decode token in every turn of the long prefill
        if num_turns == 2:  # mid-prefill: a short request arrives
            short = _prepared(worker, tiny.tokenizer.encode("short one"), _Events(), 4, method)
            worker.submit(short)
        if num_turns == 3:
            assert short.seq is not None and long.seq is None  # the short one went first, the long one goes on
    assert num_turns >= len(long_ids) // chunk  # it really ran in pieces of the budget
    assert long.seq.stats.num_prefill_chunks >= len(long_ids) // chunk
    assert long.seq.stats.num_prompt_tokens == len(long_ids)
    while worker.num_running:
        worker.run_turn()
    assert isinstance(long.emit.events[-1], DoneEvent) and isinstance(short.emit.events[-1], DoneEvent)
    assert running.emit.events[-1].num_completion_tokens == 200
    worker.stop()


def _band_after_its_span(worker: EngineWorker, tiny, max_tokens: int) -> Job:
    """A CacheBlend request whose prompt reuses the 600-token prompt of a request run to its end before it."""
    text_ids = tiny.tokenizer.encode("word " * 600)
    first = _prepared(worker, text_ids, _Events(), 1)  # published: its prompt is a span the next one reuses
    worker.submit(first)
    while not first.emit.ended.is_set():
        worker.run_turn()
    return _prepared(worker, tiny.tokenizer.encode("a preamble first, ") + text_ids, _Events(), max_tokens,
                     "cacheblend")


def test_a_prompt_reusing_a_span_prefills_its_band_in_pieces_within_the_budget_while_others_decode(tiny, monkeypatch):
    """CacheBlend's band with span tokens (it selects at a layer from every token's deviation) runs as pieces of
    layers, and a layer of its 600 tokens, costlier than the 64-token budget, as chunks of its rows: with pieces timed
    by a synthetic cost (no clock), every piece of it is predicted, and costs, within the turn's budget, and the
    running request gets one token in every turn of it."""
    pieces = _synthetic_costs(monkeypatch)
    worker = _worker(tiny, 64)
    long = _band_after_its_span(worker, tiny, 4)
    running = _prepared(worker, tiny.tokenizer.encode("a prompt that decodes for a while"), _Events(), 200)
    worker.submit(running)
    worker.run_turn()
    worker.submit(long)
    num_turns = 0
    while long.seq is None:
        before = len(running.seq.output_ids)
        worker.run_turn()
        num_turns += 1
        assert len(running.seq.output_ids) == before + 1  # a decode token in every turn of the long prefill
    assert long.seq.stats.num_reused_tokens > 500 and long.seq.plan.schedule.span_idx.numel() > 500
    layer_ms = _synthetic_ms(len(long.seq.call.prompt_ids) / tiny.config.num_layers, 0)  # a layer, attention aside
    turn_ms = worker.chunk_budget.turn_ms
    assert turn_ms == pytest.approx(_synthetic_ms(64, 64 * 65 / 2)) and layer_ms > turn_ms  # learned: exact costs
    band_ms = [_synthetic_ms(num, keys) for task, num, keys in pieces if task.call is long.seq.call]
    assert num_turns == long.seq.stats.num_prefill_chunks == len(band_ms) > 2 * tiny.config.num_layers
    assert all(ms <= turn_ms * 1.001 for ms in band_ms), band_ms
    while worker.num_running:
        worker.run_turn()
    assert isinstance(long.emit.events[-1], DoneEvent)
    worker.stop()


def test_a_prefill_starved_by_short_requests_goes_first_after_a_few_turns(tiny):
    """Short requests keep using the whole budget: the long prompt still advances every few turns."""
    worker = _worker(tiny, 8)
    worker.max_running = 64
    long = _prepared(worker, tiny.tokenizer.encode("word " * 40), _Events(), 2)
    worker.submit(long)
    progress = []
    for turn in range(12):
        for _ in range(2):  # two fresh 5-token prompts per turn: more than the budget of 8
            worker.submit(_prepared(worker, tiny.tokenizer.encode(f"s{turn} x y"), _Events(), 1))
        worker.run_turn()
        progress.append(long.task.num_remaining_tokens if long.task is not None else 0)
    assert progress[-1] < progress[0]  # it was never starved for good
    worker.stop()


def _synthetic_ms(num_tokens: float, num_keys: float) -> float:
    return 2.0 + 0.1 * num_tokens + 0.001 * num_keys


def _synthetic_costs(monkeypatch) -> list[tuple[PrefillTask, float, float]]:
    """Every prefill piece timed by ``_synthetic_ms`` (not a clock): the pieces run, (task, tokens, keys) each."""
    real_advance = PrefillTask.advance
    pieces = []

    def timed_advance(task: PrefillTask, budget_tokens: int, fits=None, min_tokens: float = 0.0) -> int:
        num = real_advance(task, budget_tokens, fits, min_tokens)
        if task.last_piece is not None:
            num_tokens, num_keys, _ = task.last_piece
            task.last_piece = (num_tokens, num_keys, _synthetic_ms(num_tokens, num_keys))
            pieces.append((task, num_tokens, num_keys))
        return num

    monkeypatch.setattr(PrefillTask, "advance", timed_advance)
    return pieces


def test_the_chunks_of_a_long_prompt_shrink_to_the_cost_of_its_first(tiny, monkeypatch):
    """Driven turn by turn, each piece timed by a synthetic cost (not a clock): attention makes a token at position
    600 cost 7x one at 0, and the worker gives later pieces fewer tokens, each within the first piece's cost."""
    synthetic_ms, pieces = _synthetic_ms, _synthetic_costs(monkeypatch)
    chunk = 64
    worker = _worker(tiny, chunk)
    running = _prepared(worker, tiny.tokenizer.encode("a prompt that decodes for a while"), _Events(), 200)
    worker.submit(running)
    worker.run_turn()
    long_ids = tiny.tokenizer.encode("word " * 600)
    long = _prepared(worker, long_ids, _Events(), 2)
    worker.submit(long)
    task = None
    while long.seq is None:
        worker.run_turn()
        task = task or long.task
    sizes = [n for t, n, _ in pieces if t is task]
    costs = [synthetic_ms(n, k) for t, n, k in pieces if t is task]
    first_ms = synthetic_ms(chunk, chunk * (chunk + 1) // 2)
    assert sum(sizes) == len(long_ids) and sizes[0] == chunk
    assert sizes[-2] < chunk // 3  # deep in the prompt (the last piece is what was left)
    assert all(a >= b for a, b in zip(sizes[3:-1], sizes[4:-1], strict=False))  # fitted after 3 pieces: shrinking
    assert all(c <= first_ms * 1.001 for c in costs[3:])  # each within the budget ...
    assert all(synthetic_ms(n + 1, k + p + 1) > first_ms for (_, n, k), p in  # ... and the most that fit it
               zip([x for x in pieces if x[0] is task][3:-1], _next_positions(sizes)[3:-1], strict=True))
    worker.stop()


def _next_positions(sizes: list[int]) -> list[int]:
    """For each piece of a full prefill, the position of the token just after it."""
    return [sum(sizes[: i + 1]) for i in range(len(sizes))]


@pytest.mark.parametrize("how", ["cancelled", "failed"])
def test_a_band_dropped_between_row_chunks_of_a_layer_frees_its_kv_and_pins_and_the_worker_goes_on(tiny, monkeypatch,
                                                                                                    how):
    """A band paused between two chunks of one layer's rows whose client goes away (or whose next piece raises): it
    leaves the prefilling set, its KV is freed, the span it reuses is unpinned, and a request sent next decodes
    normally."""
    _synthetic_costs(monkeypatch)  # pieces cost what they are predicted to: a layer of the band's is two or more
    worker = _worker(tiny, 64)
    long = _band_after_its_span(worker, tiny, 4)
    worker.submit(long)
    worker.run_turn()
    task = long.task
    assert task is not None and not task.done and task.cache is not None and worker.num_prefilling == 1  # mid-band
    partial = task._forward.partial
    assert partial is not None and 0 < partial.num_done < len(partial.positions)  # mid-layer: between row chunks
    pinned = list(long.built.pinned)
    assert pinned and all(worker.catalog.store.is_pinned(s, "ns") for s in pinned)
    if how == "cancelled":
        worker.cancel(long)
    else:
        def broken(self, *args, **kwargs):
            raise RuntimeError("planted: a layer piece that breaks")
        monkeypatch.setattr(PrefillTask, "advance", broken)
    worker.run_turn()
    monkeypatch.undo()
    assert worker.num_prefilling == 0 and long.task is None and long.seq is None
    assert task.cache is None  # its KV freed
    assert long.built.pinned == [] and not any(worker.catalog.store.is_pinned(s, "ns") for s in pinned)
    assert worker.metrics.registry.get_sample_value("kvrelay_sequence_kv_bytes") == 0
    if how == "cancelled":
        assert not long.emit.events and worker.metrics.registry.get_sample_value("kvrelay_cancelled_total") == 1
    else:
        assert isinstance(long.emit.events[-1], ErrorEvent) and long.emit.events[-1].status == 500
    after = _prepared(worker, tiny.tokenizer.encode("a prompt that decodes for a while"), _Events(), 12)
    worker.submit(after)
    while not after.emit.ended.is_set():
        worker.run_turn()
    assert isinstance(after.emit.events[-1], DoneEvent) and after.emit.events[-1].num_completion_tokens == 12
    assert worker.num_running == 0 and worker.num_prefilling == 0
    worker.stop()
