"""``/health`` as a load balancer's or Kubernetes' probe reads it: 200 only while the engine worker serves, 503 with
the reason before it starts, after its thread died and while the server shuts down (the app in process)."""

from __future__ import annotations

import threading

import pytest
from fastapi.testclient import TestClient

from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine
from kvrelay.server.app import ServerSettings, create_app
from kvrelay.server.catalog import SpanCatalog
from kvrelay.server.prompting import PromptBuild
from kvrelay.server.scheduler import Job
from kvrelay.weights.loader import load_model


@pytest.fixture
def app():
    engine = Engine(load_model("random:tiny"), KVStore(1 << 24))
    return create_app(engine, SpanCatalog(engine.store, engine.lm.fingerprint), ServerSettings())


def _health(client: TestClient) -> tuple[int, dict]:
    response = client.get("/health")
    return response.status_code, response.json()


def test_health_is_200_while_the_worker_serves_and_503_before_and_while_shutting_down(app):
    status, body = _health(TestClient(app))  # no lifespan: the worker is not started
    assert (status, body["status"]) == (503, "starting")
    with TestClient(app) as client:  # the lifespan starts the worker
        status, body = _health(client)
        assert status == 200 and body["status"] == "ok"
        assert {"model", "method", "quality_guard", "running", "prefilling", "waiting"} <= body.keys()
        assert body["tier"] is None  # memory only (a shared tier's state: tests/tier/test_tier_monitoring.py)
    status, body = _health(TestClient(app))  # the lifespan stopped it
    assert (status, body["status"]) == (503, "stopping")


def test_health_is_503_once_the_worker_thread_died(app, monkeypatch):
    """A worker thread that ended on its own leaves every queued request waiting for ever: /health said "ok"."""
    worker = app.state.worker
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the planted crash's traceback, not printed

    def crash():
        raise RuntimeError("planted: a bug outside the turn's own error handling")

    with TestClient(app) as client:
        worker.run_turn = crash  # the loop looks it up each turn
        ids = worker.tokenizer.encode("a prompt")
        worker.submit(Job(lambda: (PromptBuild(ids, []), "agent"), "ns", "full", 2, 2, 0.0, 1.0, 0, [], None,
                          False, lambda event: None))
        worker._thread.join(30)
        assert not worker._thread.is_alive()
        status, body = _health(client)
        assert (status, body["status"], body["waiting"]) == (503, "dead", 1)
