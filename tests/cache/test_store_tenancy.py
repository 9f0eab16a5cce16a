"""Tenants sharing one store: idle namespaces expire by time, never for another's put; quotas; pins."""


import pytest

from kvrelay.cache.store import KVStore
from kvrelay.cache.tenancy import TenancyConfig
from kvrelay.errors import ConfigError, KvRelayError, StoreFullError
from tests.cache.toys import Toy


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def store(idle_s: float | None = 10.0, quota: int | None = None) -> KVStore:
    return KVStore(100, block_len=2, namespace_budget_bytes=quota, namespace_idle_s=idle_s, clock=Clock())


def test_a_full_store_of_idle_namespaces_admits_a_new_namespace():
    s = store()
    for ns in ("a", "b"):
        s.put("x", Toy(50), namespace=ns)
    s.tenants.clock.now_s = 9.0
    with pytest.raises(StoreFullError):  # a and b were used 9 s ago: still theirs
        s.put("y", Toy(50), namespace="c")
    s.tenants.clock.now_s = 10.0
    assert s.put("y", Toy(50), namespace="c") == []
    assert s.namespaces() == ["c"] and s.used_bytes == 50
    assert sorted(s.take_reclaimed()) == ["x", "x"] and s.take_reclaimed() == []
    assert s.tenants.num_reclaimed == 2 and s.tenants.num_refused == {"quota": 0, "store_full": 1}
    s.check_invariants()


def test_an_active_namespace_is_never_evicted_for_another_namespace():
    s = store()
    s.put("x", Toy(60), namespace="a")
    for t in range(1, 40):  # a keeps using its span; b keeps trying to store
        s.tenants.clock.now_s = t
        assert s.get("x", namespace="a").nbytes == 60
        with pytest.raises(StoreFullError):
            s.put(f"y{t}", Toy(50), namespace="b")
    assert s.ids("a") == ["x"] and s.ids("b") == [] and s.tenants.num_reclaimed == 0


def test_expiry_depends_on_the_namespace_own_use_only():
    """What tenant a sees at each time is the same whether tenant b is busy or absent."""
    seen = []
    for busy_other in (False, True):
        s, hits = store(quota=40), []
        for t in range(25):
            s.tenants.clock.now_s = t
            if busy_other:  # b fills its share of the store every second
                s.put(f"y{t}", Toy(40), namespace="b")
            if t in (0, 5):
                s.put("x", Toy(40), namespace="a")
            if t in (3, 14, 16):
                hits.append(s.contains("x", namespace="a"))
        seen.append(hits)
    # used at 5 (put) and 14 (lookup): still there at 14 (9 s idle), then gone at 24 only
    assert seen[0] == seen[1] == [True, True, True]


def test_quota_evicts_the_namespace_own_spans_and_refuses_when_pinned():
    s = store(idle_s=None, quota=50)
    s.put("a1", Toy(30), namespace="a")
    assert s.put("a2", Toy(30), namespace="a") == ["a1"]  # over its quota: its own oldest goes
    s.put("b1", Toy(40), namespace="b")  # a3 would fit the store: only a's quota is full
    assert s.namespace_bytes("a") == 30 and s.namespace_bytes("b") == 40
    s.pin("a2", namespace="a")
    with pytest.raises(StoreFullError):
        s.put("a3", Toy(30), namespace="a")
    assert s.tenants.num_refused == {"quota": 1, "store_full": 0} and s.ids("a") == ["a2"]
    s.check_invariants()


def test_pinned_spans_keep_their_namespace_and_idle_time_starts_at_unpin():
    s = store()
    s.put("x", Toy(30), pin=True, namespace="a")
    s.put("y", Toy(30), namespace="a")
    s.tenants.clock.now_s = 100.0
    assert s.ids("a") == ["x", "y"] and s.take_reclaimed() == []  # a running request holds a pin
    s.unpin("x", namespace="a")
    s.tenants.clock.now_s = 109.0
    assert s.ids("a") == ["x", "y"]
    s.tenants.clock.now_s = 110.0
    assert s.ids("a") == [] and sorted(s.take_reclaimed()) == ["x", "y"]
    s.check_invariants()


def test_no_idle_time_keeps_namespaces():
    s = store(idle_s=None)
    s.put("x", Toy(30), namespace="a")
    s.tenants.clock.now_s = 1e9
    assert s.ids("a") == ["x"]
    with pytest.raises(KvRelayError, match="idle time"):
        s.set_namespace_idle_s(-1)


def test_config_turns_flags_into_store_settings():
    cfg = TenancyConfig(kv_namespace_budget_gb=0.5, kv_namespace_idle_s=0)
    assert cfg.namespace_budget_bytes == 1 << 29 and cfg.idle_s is None
    assert TenancyConfig().idle_s == 300.0 and TenancyConfig().namespace_budget_bytes is None
    with pytest.raises(ConfigError, match="--kv-namespace-idle-s"):
        TenancyConfig(kv_namespace_idle_s=-1)
    with pytest.raises(ConfigError, match="--kv-namespace-budget-gb"):
        TenancyConfig(kv_namespace_budget_gb=0)
