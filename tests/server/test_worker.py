"""The engine worker in process: a request that breaks while it is started fails alone."""

from __future__ import annotations

import threading

import pytest

from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine
from kvrelay.server import scheduler
from kvrelay.server.catalog import SpanCatalog
from kvrelay.server.metrics import ServerMetrics
from kvrelay.server.prompting import PromptBuild
from kvrelay.server.scheduler import EngineWorker, Job
from kvrelay.weights.loader import load_model

PLANTED = "planted: a bug met while starting this request"
GOOD_TOKENS = 200


class _Events:
    def __init__(self, other: _Events | None = None) -> None:
        self.events: list[dict] = []
        self.ended, self.first = threading.Event(), threading.Event()
        self.other = other  # whose state to note when this one ends
        self.other_ended_first: bool | None = None

    def __call__(self, event: dict) -> None:
        self.events.append(event)
        self.first.set()
        if event["type"] in ("done", "error"):
            if self.other is not None:
                self.other_ended_first = self.other.ended.is_set()
            self.ended.set()


def _job(build, emit, max_tokens: int, stop: list[str]) -> Job:
    return Job(build, "ns", "full", max_tokens, max_tokens, 0.0, 1.0, 0, stop, None, False, emit)


class _BrokenMatcher(scheduler.StopMatcher):
    def __init__(self, stops: list[str]) -> None:
        if "PLANT" in stops:
            raise RuntimeError(PLANTED)
        super().__init__(stops)


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
    assert bad.events[-1]["type"] == "error" and bad.events[-1]["status"] == 500
    assert bad.events[-1]["code"] == "internal_error" and PLANTED not in bad.events[-1]["message"]
    assert good.events[-1]["type"] == "done" and good.events[-1]["num_completion_tokens"] == GOOD_TOKENS
    assert worker.num_running == 0
    assert worker.metrics.registry.get_sample_value("kvrelay_sequence_kv_bytes") == 0  # the failed one's KV too
