"""The byte-bounded LRU shared by tenants (``kvrelay.server.fair_lru``): room is made from the heaviest API key."""

from __future__ import annotations

import pytest

from kvrelay.cache.tenancy import namespace_for
from kvrelay.server.fair_lru import FairLru
from kvrelay.server.response_store import ResponseStore, ResponseStoreConfig

A, B, C = namespace_for("a1", None), namespace_for("b2", None), namespace_for("c3", None)


def salted(tenant_namespace: str, salt: str) -> str:
    return f"{tenant_namespace}/s{salt}"


def test_without_api_keys_it_is_plain_lru():
    lru = FairLru(max_bytes=100)
    lru.put("", "k1", "v1", 40)
    lru.put(namespace_for(None, "x"), "k2", "v2", 40)  # a salt alone is no tenant: the same one as ""
    assert lru.get("", "k1") == "v1"  # k1 is now the more recent
    lru.put("", "k3", "v3", 40)
    assert lru.get(namespace_for(None, "x"), "k2") is None and lru.get("", "k1") == "v1" and lru.num_bytes == 80


def test_a_tenant_churning_its_own_entries_never_pushes_out_a_lighter_tenant():
    lru = FairLru(max_bytes=100)
    lru.put(B, "b", "kept", 30)
    for i in range(50):  # A's churn, through ever new salts (namespaces are client-chosen; its API key is not)
        assert lru.put(salted(A, str(i)), f"a{i}", i, 20)
    assert lru.get(B, "b") == "kept"
    assert lru.bytes_of(A.split("/")[0]) == 60 and lru.num_bytes == 90
    assert lru.get(salted(A, "49"), "a49") == 49 and lru.get(salted(A, "0"), "a0") is None  # A's own LRU went


def test_a_new_tenant_takes_room_from_the_heaviest_least_recent_first():
    lru = FairLru(max_bytes=100)
    lru.put(A, "a1", 1, 30)
    lru.put(B, "b1", 1, 30)
    lru.put(B, "b2", 2, 40)
    lru.get(B, "b1")  # b2 is now B's least recent
    assert lru.put(C, "c1", 1, 30)
    assert lru.get(B, "b2") is None and lru.get(B, "b1") == 1 and lru.get(A, "a1") == 1
    assert lru.put(C, "c2", 2, 40)  # C, counting c2, is now the heaviest: it pays with its own c1 first
    assert lru.get(C, "c1") is None and lru.get(A, "a1") == 1 and lru.get(B, "b1") == 1 and lru.num_bytes == 100


def test_an_entry_larger_than_any_tenant_s_holdings_still_fits_by_taking_from_the_heaviest_others():
    lru = FairLru(max_bytes=100)
    lru.put(A, "a", 1, 30)
    lru.put(B, "b", 1, 70)
    assert lru.put(C, "c", 1, 90)
    assert lru.get(C, "c") == 1 and lru.num_bytes == 90 and len(lru) == 1


def test_count_bound_per_namespace_and_what_cannot_fit():
    lru = FairLru(max_bytes=100, max_per_namespace=2)
    for key in ("k1", "k2", "k3"):
        lru.put(A, key, key, 1)
    lru.put(salted(A, "s"), "k1", "other namespace", 1)
    assert lru.get(A, "k1") is None and lru.get(A, "k3") == "k3" and lru.get(salted(A, "s"), "k1")
    assert lru.put(A, "huge", 0, 101) is False and lru.get(A, "huge") is None and len(lru) == 3
    assert lru.delete(A, "k3") and not lru.delete(A, "k3") and lru.num_bytes == 2
    with pytest.raises(ValueError):
        FairLru(max_bytes=0)
    with pytest.raises(ValueError):
        FairLru(max_bytes=1, max_per_namespace=0)


def test_one_tenant_s_large_conversations_leave_another_s_stored_response():
    """What the fairness is for: an agent loop's ``previous_response_id`` survives another API key's traffic."""
    store = ResponseStore(ResponseStoreConfig(max_bytes=20_000))
    store.put(B, "resp_b", [{"role": "user", "content": "step one"}], {"id": "resp_b"})
    for i in range(40):
        store.put(salted(A, str(i)), f"resp_a{i}", [{"role": "user", "content": "x" * 2_000}], {"id": f"resp_a{i}"})
    assert store.get(B, "resp_b").response == {"id": "resp_b"} and store.num_bytes <= 20_000


def test_on_evict_hears_of_entries_put_out_for_room_only():
    evicted = []
    lru = FairLru(max_bytes=100, max_per_namespace=2, on_evict=lambda ns, key, value: evicted.append((ns, key, value)))
    lru.put(A, "a1", "v1", 40)
    lru.put(A, "a1", "v1'", 40)  # replaced: not an eviction
    lru.put(B, "b1", "w1", 40)
    lru.delete(B, "b1")  # deleted: not an eviction
    lru.put(A, "a2", "v2", 40)
    lru.put(A, "a3", "v3", 10)  # A's third entry: its least recent goes
    lru.put(B, "b2", "w2", 60)  # over the bytes: A holds the most
    assert evicted == [(A, "a1", "v1'"), (A, "a2", "v2")]
    assert lru.get(A, "a3") == "v3" and lru.get(B, "b2") == "w2"
