"""The shared response store without a server: records checked on the way back, bounds, eviction, the disk tier."""

from __future__ import annotations

import json

import pytest

from kvrelay.server.response_store import ResponseStore, ResponseStoreConfig
from kvrelay.server.shared_responses import RECORD_KIND, SharedResponseStore, response_store_for
from kvrelay.tier.backends.base import record_key
from kvrelay.tier.backends.redis import PREFIX
from kvrelay.tier.tiered import open_store


def shared(url: str, config: ResponseStoreConfig | None = None) -> SharedResponseStore:
    store = response_store_for(open_store(url, 1 << 20, fingerprint="fp"), config)
    assert isinstance(store, SharedResponseStore)
    return store


def put(store: ResponseStore, namespace: str, rid: str, text: str = "x") -> bool:
    return store.put(namespace, rid, [{"role": "user", "content": text}], {"id": rid}, [{"id": "item"}])


def test_a_memory_store_keeps_responses_here_only():
    assert type(response_store_for(open_store("memory", 1 << 20))) is ResponseStore


@pytest.mark.parametrize("tier", ["redis", "disk"])
def test_replicas_share_responses_and_deletes(tier, redis_url, tmp_path):
    url = redis_url if tier == "redis" else f"disk:{tmp_path / 'tier'}"
    a, b = shared(url), shared(url)
    assert put(a, "ns", "r1", "hello")
    got = b.get("ns", "r1")
    assert (got.messages, got.response, got.input_items) == ([{"role": "user", "content": "hello"}], {"id": "r1"},
                                                             [{"id": "item"}])
    assert b.get("other", "r1") is None
    assert b.delete("ns", "r1") and a.get("ns", "r1") is None and len(a) == 0  # a's copy is dropped too


def test_a_record_naming_another_namespace_or_id_reads_as_none(redis_url, redis_server):
    a = shared(redis_url)
    put(a, "ns", "r1")
    raw = redis_server.client()
    value = raw.get(PREFIX + record_key(RECORD_KIND, "ns", "r1") + ":v")
    # the value copied under other keys (a forced collision): its identity does not match what is asked for
    for namespace, rid in (("other", "r1"), ("ns", "r2")):
        key = PREFIX + record_key(RECORD_KIND, namespace, rid)
        raw.set(key + ":v", value)
        raw.set(key + ":m", b"{}")
        assert shared(redis_url).get(namespace, rid) is None
    raw.set(PREFIX + record_key(RECORD_KIND, "ns", "r3") + ":v", b"\x80not json")
    raw.set(PREFIX + record_key(RECORD_KIND, "ns", "r3") + ":m", b"{}")
    reader = shared(redis_url)
    assert reader.get("ns", "r3") is None and reader.records.num_bad == 1
    assert reader.get("ns", "r1").response == {"id": "r1"}


def test_a_response_over_the_local_bound_is_written_nowhere(redis_url, redis_server):
    store = shared(redis_url, ResponseStoreConfig(max_bytes=200))
    assert not put(store, "ns", "big", "x" * 300)
    assert redis_server.client().keys("*") == [] and len(store) == 0
    assert put(store, "ns", "small")
    body = json.loads(redis_server.client().get(PREFIX + record_key(RECORD_KIND, "ns", "small") + ":v"))
    assert body["body"]["response"] == {"id": "small"}


def test_redis_evicting_half_a_record_makes_it_unknown_on_every_replica(redis_url, redis_server):
    a, b = shared(redis_url), shared(redis_url)
    put(a, "ns", "r1")
    assert b.get("ns", "r1") is not None  # now in b's memory too
    redis_server.client().delete(PREFIX + record_key(RECORD_KIND, "ns", "r1") + ":v")  # as eviction would
    assert a.get("ns", "r1") is None and b.get("ns", "r1") is None
