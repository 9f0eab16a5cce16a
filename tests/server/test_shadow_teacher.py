"""The shadow references teach the ladder's learning rungs (kvcomm), in the shadow's namespace only, driven turn by
turn on the engine worker (no thread, no timing): per-request numbers from each response's ``kvrelay`` object."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvrelay.cache.store import KVStore
from kvrelay.cache.tenancy import scoped_key
from kvrelay.engine import Engine, GenerateOptions
from kvrelay.model.sampling import SamplingConfig
from kvrelay.reuse import CallInput, Plan, ReuseMethod
from kvrelay.reuse.full import FullMethod
from kvrelay.server.catalog import SpanCatalog
from kvrelay.server.events import DoneEvent, ErrorEvent
from kvrelay.server.metrics import ServerMetrics
from kvrelay.server.prompting import PromptBuild
from kvrelay.server.quality_serving import ServedGuard
from kvrelay.server.scheduler import EngineWorker, Job
from kvrelay.server.shadow import ShadowRunner
from kvrelay.server.shadow_teacher import ShadowTeacher
from kvrelay.weights.loader import load_model

from .test_quality_shadow import _Events, _Rung, _SpyGuard

NUM_SYSTEM, NUM_DOC, NUM_TAIL = 20, 40, 8  # the role's prompt: its system prompt, a document it reads, its question
# the learning rung: kvcomm with its gate open (random:tiny's documents are all about equally far apart, a tie the
# default gate refuses; what is tested is where its anchors come from, not the gate)
KVCOMM = "kvcomm[gamma=1.0]"
TIMING_KEYS = ("ttft_ms", "queue_ms")


@pytest.fixture(scope="module")
def tiny():
    return load_model("random:tiny")


def _ids(lm, seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, lm.config.vocab_size, (n,), generator=gen).tolist()


def _worker(lm, guard: _SpyGuard, learning: list[str | ReuseMethod] | None) -> tuple[EngineWorker, ShadowTeacher]:
    """A worker whose shadows teach the ``learning`` rungs (None: no teacher, as before shadows taught)."""
    store = KVStore(1 << 28)
    engine = Engine(lm, store, methods=("full", "naive", KVCOMM))
    catalog = SpanCatalog(store, lm.fingerprint, block_len=store.block_len, decode=lm.tokenizer.decode)
    worker = EngineWorker(engine, catalog, ServerMetrics(), prefill_chunk_tokens=64)
    worker.quality = ServedGuard(guard)
    teacher = None if learning is None else ShadowTeacher(engine, learning, catalog.view)
    worker.shadows = ShadowRunner(engine, worker.quality, teacher=teacher)
    return worker, teacher


def _run(worker: EngineWorker, namespace: str, ids: list[int], agent: str, max_tokens: int = 2,
         method: str | None = None) -> DoneEvent:
    """One request to its end, and every shadow it queued compared (turn by turn)."""
    job = Job(lambda: (PromptBuild(list(ids), []), agent), namespace, method or "full", max_tokens, max_tokens, 0.0,
              1.0, 0, [], None, False, _Events(), method_named=method is not None)
    worker.prepare(job)
    worker.submit(job)
    while worker.shadows.num_pending or not (job.emit.events and isinstance(job.emit.events[-1],
                                                                              (DoneEvent, ErrorEvent))):
        worker.run_turn()
    done = job.emit.events[-1]
    assert isinstance(done, DoneEvent), done
    return done


def _role_call(worker: EngineWorker, lm, namespace: str, k: int, method: str | None = None) -> tuple[DoneEvent, list]:
    """A reader publishes document ``k``; then the role ("critic") reads it between its system prompt and question."""
    doc = _ids(lm, 100 + k, NUM_DOC)
    _run(worker, namespace, doc, "reader", max_tokens=1)
    prompt = _ids(lm, 1, NUM_SYSTEM) + doc + _ids(lm, 2, NUM_TAIL)
    return _run(worker, namespace, prompt, "critic", method=method), prompt


def _kvcomm(worker: EngineWorker):
    return worker.engine.method(KVCOMM)


def _pool(worker: EngineWorker, namespace: str):
    return _kvcomm(worker).pools.get(scoped_key(namespace, "critic/input0"))


def _public(done: DoneEvent) -> dict:
    """What a client gets, timings left out."""
    return {"text": done.text, "kvrelay": {k: v for k, v in done.kvrelay.items() if k not in TIMING_KEYS},
            "num_completion_tokens": done.num_completion_tokens}


@pytest.mark.parametrize("taught", [True, False])
def test_a_learning_rung_learns_from_the_role_shadows_and_then_reuses(tiny, taught):
    """The role runs at naive (its shadows sampled); kvcomm, a learning rung of the ladder, gets one anchor per shadow
    (the shadow's full KV: offsets against the stored document, as kvcomm's own dense prefill would record them). The
    role's next kvcomm call reuses everything but its last token; untaught, the same call falls back."""
    guard = _SpyGuard({"critic"}, _Rung("cheap", "naive"))
    worker, _ = _worker(tiny, guard, ["naive", KVCOMM, "prefix"] if taught else None)
    ns = "tenant-a"
    assert _pool(worker, ns) is None
    for k in range(3):
        done, prompt = _role_call(worker, tiny, ns, k)
        assert done.kvrelay["method"] == "naive"
    assert len(guard.records) == 3  # every shadow compared and recorded
    if taught:
        anchors = _pool(worker, ns).anchors
        assert len(anchors) == 3
        # the last anchor's value offsets are full's KV of the document in the role's prompt minus the stored
        # document's: what a dense prefill computes, not what the naive live call reused (offset 0)
        dense = worker.engine.generate(CallInput(prompt), "full", GenerateOptions(
            SamplingConfig(max_new_tokens=1), keep_cache=True, feed_last=False, learn=False))
        expected_dv = dense.cache.v[:, :, NUM_SYSTEM : NUM_SYSTEM + NUM_DOC] - anchors[-1].base_v  # base: the doc
        expected_dv[0] = 0
        assert anchors[-1].dv.abs().amax() > 1e-3
        torch.testing.assert_close(anchors[-1].dv, expected_dv, atol=1e-4, rtol=1e-4)
    else:
        assert _pool(worker, ns) is None
    done, prompt = _role_call(worker, tiny, ns, 3, method=KVCOMM)
    assert done.kvrelay["method"] == "kvcomm"
    if taught:
        assert done.kvrelay["fallback"] is None
        assert done.kvrelay["num_reused_tokens"] == len(prompt) - 1  # all but the last token (kvcomm's tail)
    else:
        assert done.kvrelay["fallback"].startswith("kvcomm: placeholder 'critic/input0' has 0 of 2 anchors")
        assert done.kvrelay["num_reused_tokens"] < NUM_SYSTEM + NUM_DOC
    worker.stop()


def _tenant_b(worker: EngineWorker, lm, with_a: bool) -> list[dict]:
    """Tenant B's traffic (every call shadowed, the fourth at kvcomm), tenant A's before each of B's calls or not."""
    out = []
    for k in range(4):
        if with_a:
            _role_call(worker, lm, "tenant-a", 50 + k)
        done, _ = _role_call(worker, lm, "tenant-b", k, method=KVCOMM if k == 3 else None)
        out.append(_public(done))
    return out


def test_one_tenant_shadows_never_teach_another(tiny):
    runs = {}
    for with_a in (False, True):
        guard = _SpyGuard({"critic"}, _Rung("cheap", "naive"))
        worker, teacher = _worker(tiny, guard, ["naive", KVCOMM, "prefix"])
        responses = _tenant_b(worker, tiny, with_a)
        pool = _pool(worker, "tenant-b")
        runs[with_a] = (responses, [(a.dk, a.dv, a.base_v) for a in pool.anchors] if pool else [],
                        teacher.num_taught)
        if with_a:
            assert len(_pool(worker, "tenant-a").anchors) == 4  # A's shadows taught A
        worker.stop()
    (alone, anchors_alone, taught_alone), (beside, anchors_beside, taught_beside) = runs[False], runs[True]
    assert taught_alone == 3 and taught_beside == 7  # B's 4th call ran kvcomm itself: it learned from its own prefill
    assert alone[3]["kvrelay"]["fallback"] is None  # B's kvcomm call reused on B's own shadows' anchors
    assert alone == beside
    assert len(anchors_alone) == len(anchors_beside) == 3
    for mine, theirs in zip(anchors_alone, anchors_beside, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            assert torch.equal(a, b)


@dataclass
class _BrokenLearner(ReuseMethod):
    """A learning rung whose lesson fails."""

    name = "broken"
    stateful = True

    def plan(self, call, store, lm) -> Plan:
        return FullMethod().plan(call, store, lm)

    def dense_plan(self, call) -> Plan:
        return Plan(None)

    def observe(self, call, plan, cache, store, lm) -> None:
        if plan.schedule is None:
            raise RuntimeError("a lesson that breaks")


def test_a_lesson_that_fails_is_counted_and_its_shadow_still_measured_and_live_requests_do_not_see_it(tiny):
    runs = {}
    for broken in (False, True):
        guard = _SpyGuard({"critic"}, _Rung("cheap", "naive"))
        worker, _ = _worker(tiny, guard, [_BrokenLearner()] if broken else ["naive"])
        responses = [_public(_role_call(worker, tiny, "tenant-a", k)[0]) for k in range(2)]
        runs[broken] = (responses, worker.shadows.num_failed, worker.shadows.teacher.num_failed,
                        [r[:6] for r in guard.records], worker.shadows.num_runs)  # records: all but the cost
        worker.stop()
    assert runs[False][1:3] == (0, 0) and runs[False][4] == 2
    assert runs[True][1:3] == (0, 2)  # both lessons failed and were counted; no shadow dropped
    assert runs[True][3] == runs[False][3] and runs[True][4] == 2  # the guard got the same measurements
    assert runs[True][0] == runs[False][0]  # the live requests got the same answers
