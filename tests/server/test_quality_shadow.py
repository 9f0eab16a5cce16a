"""Shadow references on the engine worker, driven turn by turn (no thread, no timing): they wait while a live prefill
waits, and what they record equals an offline computation of the same KL with the engine in process."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvrelay.cache.kv import SequenceKV
from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine, GenerateOptions
from kvrelay.eval.fidelity import kl_first_token
from kvrelay.model.sampling import SamplingConfig
from kvrelay.server.catalog import SpanCatalog
from kvrelay.server.events import DoneEvent, ErrorEvent
from kvrelay.server.metrics import ServerMetrics
from kvrelay.server.prompting import PromptBuild
from kvrelay.server.quality_metrics import QualityMetrics
from kvrelay.server.quality_serving import ServedGuard
from kvrelay.server.scheduler import EngineWorker, Job
from kvrelay.server.shadow import CONTINUATION_TOKENS, ShadowRunner
from kvrelay.weights.loader import load_model

NS = "tenant"


class _Rung:
    def __init__(self, name: str, method_spec: str) -> None:
        self.name, self.method_spec = name, method_spec


class _SpyGuard:
    """The guard's interface: one fixed rung; samples the roles it is told to; keeps what is recorded."""

    def __init__(self, sampled_roles: set[str], rung: _Rung) -> None:
        self.sampled_roles, self.rung = sampled_roles, rung
        self.records: list[tuple] = []

    def rung_for(self, namespace: str, role: str, requested: bool = False) -> _Rung:
        return self.rung

    def paced(self, namespace: str) -> bool:  # the guard's turnover: the pacer tests set it
        return getattr(self, "pace", False)

    def should_shadow(self, namespace: str, role: str, affordable=True, setting=None) -> bool:
        # as the guard: a callable (the pacer's draw) is asked only for a call the rule wants
        return role in self.sampled_roles and (affordable() if callable(affordable) else affordable)

    def record(self, *args) -> None:
        self.records.append(args)

    def aggregates(self) -> dict:
        return {"rung_moves": {}, "roles_per_rung": {}}


class _Events:
    def __init__(self) -> None:
        self.events: list[dict] = []

    def __call__(self, event: dict) -> None:
        self.events.append(event)


@pytest.fixture(scope="module")
def tiny():
    return load_model("random:tiny")


def _worker(lm, guard: _SpyGuard, chunk_tokens: int) -> EngineWorker:
    store = KVStore(1 << 28)
    engine = Engine(lm, store, methods=("full", "naive"))
    worker = EngineWorker(engine, SpanCatalog(store, lm.fingerprint, block_len=store.block_len,
                                              decode=lm.tokenizer.decode),
                          ServerMetrics(), prefill_chunk_tokens=chunk_tokens)
    worker.quality = ServedGuard(guard)
    worker.shadows = ShadowRunner(engine, worker.quality)
    return worker


def _job(worker: EngineWorker, ids: list[int], agent: str, max_tokens: int, method: str = "full",
         named: bool = False) -> Job:
    job = Job(lambda: (PromptBuild(list(ids), []), agent), NS, method, max_tokens, max_tokens, 0.0, 1.0, 0, [], None,
              False, _Events(), method_named=named)
    worker.prepare(job)
    return job


def _drain(worker: EngineWorker, *jobs: Job) -> None:
    """Turns until every job has ended and no shadow is pending."""
    while worker.shadows.num_pending or not all(j.emit.events and isinstance(j.emit.events[-1], (DoneEvent, ErrorEvent))
                                                for j in jobs):
        worker.run_turn()


def test_a_shadow_does_not_run_while_a_live_prefill_waits(tiny):
    chunk = 8
    guard = _SpyGuard({"sampled"}, _Rung("cheap", "naive"))
    worker = _worker(tiny, guard, chunk)
    sampled = _job(worker, tiny.tokenizer.encode("a sampled request " * 3), "sampled", 40)
    worker.submit(sampled)
    while sampled.seq is None:  # its prefill and first token; its shadow is queued
        worker.run_turn()
    assert sampled.seq is not None and worker.shadows.num_pending == 1
    registry = CollectorRegistry()
    QualityMetrics(registry, worker.quality, worker.shadows)
    assert registry.get_sample_value("kvrelay_quality_shadows_pending") == 1  # what a benchmark waits on
    long = _job(worker, tiny.tokenizer.encode("word " * 80), "other", 2)
    worker.submit(long)
    shadow = worker.shadows._pending[0]

    def progress() -> tuple[int, int]:  # (prompt chunks the shadow ran, the ones it had begun before)
        return (0, 0) if shadow.task is None else (shadow.task.num_chunks, shadow.task.num_remaining_tokens)

    before = progress()
    assert before == (0, 0) or before[1] > 0  # its prompt is not done yet: it has work it could do
    num_turns = 0
    while long.seq is None:  # the long prompt prefills in pieces of ``chunk`` tokens, one per turn
        worker.run_turn()
        num_turns += 1
        if long.seq is None:
            assert progress() == before  # no shadow work while a live prefill waits
    assert num_turns >= 80 // chunk
    assert not guard.records
    _drain(worker, sampled, long)  # no live prefill left: the shadow advances in the turns that follow
    assert [(r[0], r[1], r[2]) for r in guard.records] == [(NS, "sampled", "cheap")]
    assert registry.get_sample_value("kvrelay_quality_shadows_pending") == 0
    worker.stop()


def test_a_request_not_sampled_gets_no_shadow_and_a_named_method_is_kept(tiny):
    guard = _SpyGuard(set(), _Rung("cheap", "naive"))
    worker = _worker(tiny, guard, 64)
    picked = _job(worker, tiny.tokenizer.encode("the rung picks my method"), "a", 3)
    named = _job(worker, tiny.tokenizer.encode("I name my method"), "a", 3, method="full", named=True)
    assert (picked.method, picked.quality.rung, picked.quality.measured_as) == ("naive", "cheap", "cheap")
    assert (named.method, named.quality.rung, named.quality.measured_as) == ("full", "cheap", "requested:full")
    for job in (picked, named):
        worker.submit(job)
    _drain(worker, picked, named)
    assert worker.shadows.num_pending == 0 and not guard.records
    done = picked.emit.events[-1]
    assert isinstance(done, DoneEvent) and done.kvrelay["method"] == "naive"
    assert done.kvrelay["quality"] == {"role": "a", "rung": "cheap"}
    assert named.emit.events[-1].kvrelay["method"] == "full"
    worker.stop()


def _offline(engine: Engine, call, store, num_tokens: int) -> tuple[float, bool, float, list[int]]:
    """The same comparison computed another way: the method's call with its logits kept by a mask of the test's
    own, and ``full`` as one unchunked forward over prompt + continuation with every position's logits."""

    class Keep:
        def __init__(self) -> None:
            self.logits: list[torch.Tensor] = []

        def apply(self, logits):
            self.logits.append(logits.float().clone())
            return logits

        def advance(self, token_id):
            pass

    keep = Keep()
    seq = engine.start(call, "naive", GenerateOptions(SamplingConfig(num_tokens, 0.0), logits_mask=keep,
                                                      learn=False), store=store)
    while not seq.done:
        engine.step([seq])
    engine.finish(seq)
    continuation = seq.output_ids[:CONTINUATION_TOKENS]
    num_prompt = len(call.prompt_ids)
    lm = engine.lm
    ids = torch.tensor(call.prompt_ids + continuation, dtype=torch.long)
    cache = SequenceKV(lm.config, lm.model.dtype, lm.model.device, capacity=len(ids) + 1)
    full = lm.model.prefill(ids, cache, all_logits=True).logits  # [num_prompt + num_continuation, vocab]
    first_kl = kl_first_token(full[num_prompt - 1], keep.logits[0])
    agree = int(full[num_prompt - 1].argmax()) == int(keep.logits[0].argmax())
    rows = [kl_first_token(full[num_prompt + i], keep.logits[1 + i]) for i in range(len(continuation))]
    return first_kl, agree, sum(rows) / len(rows), continuation


def test_the_recorded_numbers_equal_an_offline_computation_of_the_same_kl(tiny):
    guard = _SpyGuard({"reader"}, _Rung("cheap", "naive"))
    worker = _worker(tiny, guard, 16)
    shared = tiny.tokenizer.encode("the shared document that every agent reads, " * 4)
    writer = _job(worker, shared, "writer", 4)
    worker.submit(writer)
    _drain(worker, writer)
    reader_ids = tiny.tokenizer.encode("a different start. ") + shared + tiny.tokenizer.encode(" now answer")
    reader = _job(worker, reader_ids, "reader", 12)
    assert reader.built.call.refs  # it reads the writer's span
    worker.submit(reader)
    _drain(worker, reader)
    done = reader.emit.events[-1]
    assert isinstance(done, DoneEvent) and done.num_cached_tokens > 0 and done.kvrelay["method"] == "naive"
    [(namespace, role, rung, first_kl, agree, continuation_kl, cost_ms)] = guard.records
    assert (namespace, role, rung) == (NS, "reader", "cheap") and cost_ms > 0
    offline_kl, offline_agree, offline_continuation_kl, continuation = _offline(
        worker.engine, reader.built.call, worker.catalog.view(NS), 12)
    assert len(continuation) == CONTINUATION_TOKENS
    assert offline_kl > 1e-4 and offline_continuation_kl > 1e-4  # naive's reuse really moved the logits
    assert first_kl == pytest.approx(offline_kl, rel=1e-5, abs=1e-9)
    assert agree == offline_agree
    assert continuation_kl == pytest.approx(offline_continuation_kl, rel=1e-5, abs=1e-9)
    worker.stop()


def test_a_shadow_piece_fits_the_turn_budget_a_live_piece_gets(tiny, monkeypatch):
    """A shadow reference deep in a long prompt runs pieces sized by the worker's ChunkBudget (predicted time), not
    ``prefill_chunk_tokens`` tokens: with a fit where a token at position p costs 1 + p/10 ms, each of its pieces is
    predicted within one turn (or is the budget's least piece), as a live prefill's pieces are."""
    chunk = 16
    guard = _SpyGuard({"sampled"}, _Rung("cheap", "naive"))
    worker = _worker(tiny, guard, chunk)
    sampled = _job(worker, tiny.tokenizer.encode("word " * 120), "sampled", 40)
    worker.submit(sampled)
    while sampled.seq is None:
        worker.run_turn()
    budget = worker.chunk_budget
    monkeypatch.setattr(budget, "observe", lambda piece: None)  # a fixed fit: no measured time moves it
    budget.coef_ms = (0.0, 1.0, 0.1)
    shadow = worker.shadows._pending[0]
    pieces = []
    while worker.shadows.num_pending:
        worker.run_turn()
        if shadow.task is not None and shadow.task.last_piece is not None and shadow.task.num_chunks > len(pieces):
            pieces.append(shadow.task.last_piece[:2])
    assert len(pieces) > len(sampled.seq.prompt_ids) // chunk  # deep pieces got fewer tokens than the flag's
    for num_tokens, num_keys in pieces:
        assert num_tokens <= budget.min_tokens or budget.predict_ms(num_tokens, num_keys) <= budget.turn_ms
    assert [(r[0], r[1], r[2]) for r in guard.records] == [(NS, "sampled", "cheap")]
    worker.stop()
