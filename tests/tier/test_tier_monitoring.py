"""The shared tier as monitoring sees it: ``/health``'s ``tier`` object (a down tier leaves the replica healthy: it
serves from memory), ``kvrelay_tier_up`` and the tier's counters on ``/metrics`` (exact counts), and a request's
``kvrelay.debug.tier_decisions``."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from fastapi.testclient import TestClient

from kvrelay.cache.kv import StoredSpan
from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine
from kvrelay.server.app import ServerSettings, create_app
from kvrelay.server.catalog import SpanCatalog
from kvrelay.server.metrics import ServerMetrics
from kvrelay.tier.backends.disk import DiskBackend
from kvrelay.tier.tiered import TieredStore, open_store
from kvrelay.weights.loader import load_model
from tests.tier.test_tier_prober import hanging_store

MODEL = "random:tiny"


def span(n: int = 20) -> StoredSpan:
    k = torch.randn(2, 2, n, 4, generator=torch.Generator().manual_seed(n))
    return StoredSpan(tuple(range(100, 100 + n)), 0, k, -k, "fp")


@contextmanager
def served(store: KVStore, method: str = "full") -> Iterator[TestClient]:
    lm = load_model(MODEL)
    catalog = SpanCatalog(store, lm.fingerprint, block_len=store.block_len, decode=lm.tokenizer.decode)
    app = create_app(Engine(lm, store, methods=(method, "full")), catalog, ServerSettings(method=method))
    with TestClient(app) as client:
        yield client


def chat(client: TestClient, messages: list[dict], max_tokens: int = 4) -> dict:
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                         "max_tokens": max_tokens, "temperature": 0,
                                                         "kvrelay": {"debug": True}})
    assert response.status_code == 200, response.text
    return response.json()


def sample(client: TestClient, name: str, labels: str = "") -> float | None:
    """A sample's value on the ``/metrics`` page (None: no such sample)."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f"{name}{labels} "):
            return float(line.split()[-1])
    return None


def test_counts_of_lookups_and_calls_are_exact():
    store, backend, _steps = hanging_store()
    metrics = ServerMetrics()
    metrics.observe_store(store)
    value = metrics.registry.get_sample_value
    store.put("a", span(20))
    store.remove("a")
    assert "a" in store  # fetched
    assert "b" not in store  # not in the tier: a miss
    assert value("kvrelay_tier_up") == 1
    backend.hung.set()
    assert "a-again" not in store  # fails: the tier is down
    assert "a-again" not in store and "c" not in store  # skipped
    assert value("kvrelay_tier_up") == 0
    assert {r: value("kvrelay_tier_lookups_total", {"result": r}) for r in ("fetch", "recompute", "miss")} == \
        {"fetch": 1, "recompute": 0, "miss": 4}
    assert value("kvrelay_tier_failed_calls_total") == 1 and value("kvrelay_tier_skipped_calls_total") == 2
    store.close()


def test_a_memory_store_has_no_tier_sample_and_health_says_none():
    with served(KVStore(1 << 24)) as client:
        page = client.get("/metrics").text
        assert "# TYPE kvrelay_tier_up gauge" in page  # the family is there, documented...
        assert sample(client, "kvrelay_tier_up") is None  # ...with no sample: no tier is not a tier that is down
        assert client.get("/health").json()["tier"] is None


def test_a_redis_with_a_wrong_password_is_down_in_health_and_metrics_and_the_replica_serves(own_redis):
    own_redis.client().config_set("requirepass", "right-password")
    wrong = own_redis.url.replace("redis://", "redis://default:wrong-password@")
    lm = load_model(MODEL)
    store = open_store(wrong, 1 << 26, fingerprint=lm.fingerprint)  # the connect ping fails: down from the start
    try:
        with served(store) as client:
            health = client.get("/health")
            assert health.status_code == 200 and health.json()["status"] == "ok"
            tier = health.json()["tier"]
            assert (tier["kind"], tier["up"]) == ("redis", False) and tier["down_for_s"] >= 0
            assert sample(client, "kvrelay_tier_up") == 0
            assert sample(client, "kvrelay_tier_failed_calls_total") == 1
            assert chat(client, [{"role": "user", "content": "hello"}])["choices"]  # served, memory only
            assert "password" not in health.text
    finally:
        store.close()


def test_debug_lists_the_tier_decisions_of_the_calls_lookups():
    """Replica B continues a conversation replica A answered: its lookup fetches A's span from the tier, and B's
    debug object lists that decision, with the lookup's own facts only."""
    lm = load_model(MODEL)
    with tempfile.TemporaryDirectory() as tier:
        stores = [open_store(f"disk:{tier}", 1 << 26, fingerprint=lm.fingerprint) for _ in range(2)]
        with served(stores[0], "prefix") as a, served(stores[1], "prefix") as b:
            messages = [{"role": "user", "content": "tell me a long story about the sea and ships " * 4}]
            first = chat(a, messages, max_tokens=8)
            assert first["kvrelay"]["debug"]["tier_decisions"] == []  # nothing looked up in the tier
            messages += [first["choices"][0]["message"], {"role": "user", "content": "more"}]
            decisions = chat(b, messages)["kvrelay"]["debug"]["tier_decisions"]
            assert [(d["span_id"], d["action"]) for d in decisions] == [
                (first["kvrelay"]["debug"]["span_id"], "fetch")]
            assert set(decisions[0]) == {"span_id", "action", "reason", "num_tokens", "value_bytes", "fetch_ms"}
            assert sample(b, "kvrelay_tier_lookups_total", '{result="fetch"}') == 1


def test_the_server_publishes_without_waiting_on_the_tier_and_metrics_show_what_is_owed(tmp_path):
    from tests.tier.test_tier_writer import WAIT_S, HeldBackend

    backend = HeldBackend(tmp_path)  # every write held until released: a hung or very slow tier
    store = TieredStore(1 << 26, backend)
    with served(store) as client:
        first = chat(client, [{"role": "user", "content": "A first question about rivers."}])
        assert backend.writing.wait(WAIT_S)  # its span's write has begun, and is held
        chat(client, [{"role": "user", "content": "A second, unrelated one."}])  # served meanwhile
        assert sample(client, "kvrelay_tier_unwritten_spans") == 2
        assert sample(client, "kvrelay_tier_up") == 1  # slow, not down
        backend.released.set()
        assert store.writer.wait_written(WAIT_S)
        assert sample(client, "kvrelay_tier_unwritten_spans") == 0
    assert len(backend.keys) == 2 and store.writer is None  # the app's shutdown handed writes back
    reader = TieredStore(1 << 26, DiskBackend(tmp_path), store.fingerprint)
    assert first["kvrelay"]["debug"]["span_id"] in reader


def test_an_idle_replica_shows_a_dead_tier_down_in_health_and_metrics():
    """No request touches the tier: the watcher's ping alone turns /health's tier and kvrelay_tier_up to down."""
    from tests.tier.test_tier_prober import STEP_TIMEOUT_S, Steps, _wait_for

    store, backend, _steps = hanging_store()
    watch = Steps()
    store.health.watch(wait=watch.wait)
    try:
        with served(store) as client:
            assert client.get("/health").json()["tier"]["up"] is True and sample(client, "kvrelay_tier_up") == 1
            backend.hung.set()  # Redis killed
            watch.step()
            assert backend.probes.get(timeout=STEP_TIMEOUT_S) is False
            _wait_for(lambda: not store.health.up)
            health = client.get("/health")
            assert health.status_code == 200 and health.json()["tier"]["up"] is False
            assert sample(client, "kvrelay_tier_up") == 0
            assert sample(client, "kvrelay_tier_failed_calls_total") == 0  # a ping, not a caller's call
    finally:
        store.close()
