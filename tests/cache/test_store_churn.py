"""A store that serves for weeks: tenants that come and go (a ``cache_salt`` per conversation) and endless evictions
leave nothing behind in its bookkeeping."""

import pytest

from kvrelay.cache.store import KVStore
from kvrelay.errors import StoreFullError
from tests.cache.test_store_tenancy import Clock
from tests.cache.toys import Toy
from tests.retained import MAX_BOUNDED_BYTES_PER_CALL, NUM_WINDOWS, retained_bytes_per_call


def test_every_way_a_namespace_empties_forgets_it():
    """Removed, evicted by its own put, expired idle, or refused its only put: no namespace is kept empty."""
    s = KVStore(100, block_len=2, namespace_budget_bytes=60, namespace_idle_s=10.0, clock=Clock())
    s.put("x", Toy(30), namespace="idle")
    s.tenants.clock.now_s = 10.0
    s.put("x", Toy(40), namespace="removed")  # idle expires on this put
    s.remove("x", namespace="removed")
    s.put("x", Toy(40), namespace="replaced")
    s.put("y", Toy(40), namespace="replaced")  # its quota evicts its own x
    s.put("big", Toy(50), namespace="live", pin=True)
    assert s.namespaces() == ["replaced", "live"] and s.tenants.num_reclaimed == 1
    with pytest.raises(StoreFullError):  # pinned and live spans leave no room: refused, nothing kept
        s.put("z", Toy(60), namespace="refused")
    s.check_invariants()  # which fails on a namespace kept empty
    assert s.num_evicted == 1


def test_salt_churn_keeps_nothing_per_namespace():
    s = KVStore(1000, block_len=2, namespace_idle_s=None)

    def conversation(i: int) -> None:
        s.put(f"span{i}", Toy(10), namespace=f"k0/s{i:08d}")
        s.remove(f"span{i}", namespace=f"k0/s{i:08d}")

    assert retained_bytes_per_call(conversation) <= MAX_BOUNDED_BYTES_PER_CALL
    assert len(s) == 0 and s.namespaces() == []


def test_evictions_keep_nothing_per_eviction():
    s = KVStore(100, block_len=2)

    def put(i: int) -> None:  # each put of 60 bytes evicts the one before
        s.put(f"span{i:08d}", Toy(60, token_ids=(i, i + 1, i + 2)))

    num_calls = 2000
    assert retained_bytes_per_call(put, num_calls) <= MAX_BOUNDED_BYTES_PER_CALL
    assert s.num_evicted == (1 + NUM_WINDOWS) * num_calls - 1 and len(s) == 1  # every put but the last evicted
