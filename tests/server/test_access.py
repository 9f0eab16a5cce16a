"""Who reads /metrics and the OpenAPI pages (``server.access``); the app in process, its worker not started."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine
from kvrelay.errors import ConfigError
from kvrelay.server.access import read_metrics_key
from kvrelay.server.app import ServerSettings, create_app
from kvrelay.server.catalog import SpanCatalog
from kvrelay.weights.loader import load_model

PAGES = ("/openapi.json", "/docs", "/redoc")


@pytest.fixture(scope="module")
def engine():
    return Engine(load_model("random:tiny"), KVStore(1 << 24))


def _client(engine, api_keys=(), metrics_key=None) -> TestClient:
    catalog = SpanCatalog(engine.store, engine.lm.fingerprint)
    return TestClient(create_app(engine, catalog, ServerSettings(api_keys=frozenset(api_keys),
                                                                  metrics_key=metrics_key)))


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _error(r) -> dict:
    body = r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_a_single_user_server_is_open(engine):
    client = _client(engine)
    assert client.get("/metrics").status_code == 200
    assert all(client.get(page).status_code == 200 for page in PAGES)


def test_with_api_keys_no_tenant_key_reads_metrics_and_the_docs_need_a_key(engine):
    client = _client(engine, api_keys=("tenant-a", "tenant-b"))
    for headers in ({}, _auth("tenant-a"), _auth("wrong")):
        r = client.get("/metrics", headers=headers)
        assert r.status_code == 401 and "--metrics-key" in _error(r)["message"]
    for page in PAGES:
        assert client.get(page).status_code == 401 and _error(client.get(page))["code"] == "invalid_api_key"
        assert client.get(page, headers=_auth("wrong")).status_code == 401
        assert client.get(page, headers=_auth("tenant-b")).status_code == 200
    schema = client.get("/openapi.json", headers=_auth("tenant-a")).json()
    assert "/v1/chat/completions" in schema["paths"] and "/openapi.json" not in schema["paths"]


def test_a_missing_route_lists_the_served_ones_only_to_who_may_read_the_schema(engine):
    """The 404/405 body is the schema in short: with API keys, a caller without one learns only that it missed."""
    open_client, keyed = _client(engine), _client(engine, api_keys=("tenant-a",), metrics_key="scrape")
    for client, headers, listed in ((open_client, {}, True), (keyed, {}, False), (keyed, _auth("wrong"), False),
                                    (keyed, _auth("tenant-a"), True), (keyed, _auth("scrape"), True)):
        for r in (client.get("/v1/embeddings", headers=headers), client.get("/v1/chat/completions", headers=headers)):
            message = _error(r)["message"]
            assert r.status_code in (404, 405) and message.startswith(f"GET {r.request.url.path}: ")
            assert ("/v1/chat/completions" in message.split(": ", 1)[1]) is listed, (headers, message)


@pytest.mark.parametrize("api_keys", [(), ("tenant-a",)])
def test_the_metrics_key_opens_metrics_and_nothing_else_does(engine, api_keys):
    client = _client(engine, api_keys=api_keys, metrics_key="scraper")
    r = client.get("/metrics", headers=_auth("scraper"))
    assert r.status_code == 200 and "kvrelay_store_bytes" in r.text
    for headers in ({}, _auth("tenant-a"), _auth("scrape"), _auth("scraperx")):
        assert client.get("/metrics", headers=headers).status_code == 401
    if api_keys:  # the operator's key reads the docs too
        assert client.get("/openapi.json", headers=_auth("scraper")).status_code == 200


def test_the_metrics_key_file(tmp_path):
    assert read_metrics_key(None) is None
    (tmp_path / "key").write_text("\n  s3cret \nother\n")
    assert read_metrics_key(str(tmp_path / "key")) == "s3cret"
    (tmp_path / "empty").write_text("\n \n")
    for path in (tmp_path / "empty", tmp_path / "missing"):
        with pytest.raises(ConfigError, match="--metrics-key"):
            read_metrics_key(str(path))
