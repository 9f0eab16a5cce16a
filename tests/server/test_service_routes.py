"""``/v1/models`` and ``/v1/models/{id}`` through the official client; the app in process, its worker not started."""

from __future__ import annotations

import openai
import pytest
from fastapi.testclient import TestClient

from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine
from kvrelay.server.app import ServerSettings, create_app
from kvrelay.server.catalog import SpanCatalog
from kvrelay.weights.loader import load_model


@pytest.fixture(scope="module")
def http() -> TestClient:
    engine = Engine(load_model("random:tiny"), KVStore(1 << 24))
    catalog = SpanCatalog(engine.store, engine.lm.fingerprint)
    return TestClient(create_app(engine, catalog, ServerSettings(api_keys=frozenset({"tenant-a"}))))


def _client(http: TestClient, key: str = "tenant-a") -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0)


def test_the_served_model_is_listed_and_retrieved(http):
    client = _client(http)
    [listed] = client.models.list().data
    # models.retrieve() was a 404 (no such route): a client checking the model before it runs failed
    model = client.models.retrieve(listed.id)
    assert model.id == listed.id and model.object == "model"


def test_another_model_is_a_404_model_not_found_and_a_key_is_needed(http):
    with pytest.raises(openai.NotFoundError) as err:
        _client(http).models.retrieve("gpt-4o")
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    with pytest.raises(openai.AuthenticationError):
        _client(http, "wrong").models.retrieve("random:tiny")


def test_a_huge_id_is_not_echoed_back_whole(http):
    """The 404 quotes the model id it got: 60,000 characters came back whole (and so would any echoed value)."""
    with pytest.raises(openai.NotFoundError) as err:
        _client(http).models.retrieve("m" * 60_000)
    message = err.value.body["message"]
    assert "characters left out" in message and len(message) < 2_200, len(message)
    assert message.startswith("the model 'mmm")  # still says what it got


def test_health_says_whether_the_quality_guard_or_the_method_serves():
    """With the guard on, a request that names no method runs at its agent's rung: /health said ``--method``."""
    from kvrelay.quality.config import QualityConfig

    for quality, method, guarded in ((QualityConfig(), None, True), (None, "epic", False)):
        engine = Engine(load_model("random:tiny"), KVStore(1 << 24))
        catalog = SpanCatalog(engine.store, engine.lm.fingerprint)
        app = create_app(engine, catalog, ServerSettings(method="epic", quality=quality))
        health = TestClient(app).get("/health").json()
        assert (health["method"], health["quality_guard"]) == (method, guarded), health
