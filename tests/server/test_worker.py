"""The engine worker in process: a request that breaks while it is admitted fails alone."""

from __future__ import annotations

import threading

from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine
from kvrelay.server.catalog import SpanCatalog
from kvrelay.server.metrics import ServerMetrics
from kvrelay.server.prompting import PromptBuild
from kvrelay.server.scheduler import EngineWorker, Job
from kvrelay.weights.loader import load_model


class _Events:
    def __init__(self) -> None:
        self.events: list[dict] = []
        self.ended = threading.Event()
        self.first = threading.Event()

    def __call__(self, event: dict) -> None:
        self.events.append(event)
        self.first.set()
        if event["type"] in ("done", "error"):
            self.ended.set()


def _job(build, emit, max_tokens: int) -> Job:
    return Job(build, "ns", "full", max_tokens, max_tokens, 0.0, 1.0, 0, [], None, False, emit)


def test_a_request_that_breaks_in_admission_fails_alone():
    lm = load_model("random:tiny")
    store = KVStore(1 << 28)
    worker = EngineWorker(Engine(lm, store), SpanCatalog(store, lm.fingerprint), ServerMetrics())
    ids = lm.tokenizer.encode("a prompt that decodes for a while")
    good, bad = _Events(), _Events()

    def broken():
        raise RuntimeError("planted: a bug met while building this request")

    worker.start()
    try:
        worker.submit(_job(lambda: (PromptBuild(ids, []), "agent"), good, 200))
        assert good.first.wait(30)  # admitted: its first token is out, it is running
        worker.submit(_job(broken, bad, 4))
        assert bad.ended.wait(30) and good.ended.wait(60)
    finally:
        worker.stop()
    assert bad.events[-1]["type"] == "error" and bad.events[-1]["status"] == 500
    assert bad.events[-1]["code"] == "internal_error" and "planted" not in bad.events[-1]["message"]
    assert good.events[-1]["type"] == "done" and good.events[-1]["num_completion_tokens"] == 200
    assert worker.num_running == 0
