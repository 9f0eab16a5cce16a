"""The store under random operation sequences, single- and multi-threaded, and input checks on put.

Invariants after every step: bytes within the budget (and the namespace budget), used bytes equal to
the sum of live spans, a pinned span never evicted, a put never evicting another namespace's span,
and no error that is not a KvRelayError.
"""

from __future__ import annotations

import random
import sys
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay.cache.store import KVStore, SpanNotFoundError
from kvrelay.errors import KvRelayError, StoreFullError
from tests.cache.toys import Toy

BUDGET_BYTES = 1000
NAMESPACES = ("", "t1", "t2")




span_ids = st.sampled_from([f"s{i}" for i in range(8)])
namespaces = st.sampled_from(NAMESPACES)
ops = st.one_of(
    st.tuples(st.just("put"), namespaces, span_ids, st.integers(0, 600), st.booleans()),
    st.tuples(st.sampled_from(["get", "remove", "pin", "unpin", "contains"]), namespaces, span_ids),
    st.tuples(st.just("match"), namespaces, st.lists(st.integers(0, 5), max_size=10)),
    st.tuples(st.just("tick"), namespaces, st.integers(0, 3)),  # the clock moves on (namespace expiry)
)


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def apply(store: KVStore, op: tuple) -> list[str]:
    """Run one operation; returns the ids a put evicted."""
    kind, ns = op[0], op[1]
    if kind == "put":
        _, _, sid, nbytes, pin = op
        return store.put(sid, Toy(nbytes, tuple(range(nbytes % 7 + 4))), pin, namespace=ns)
    if kind == "tick":
        if isinstance(store.tenants.clock, Clock):  # a store on the real clock just goes on
            store.tenants.clock.now_s += op[2]
    elif kind == "match":
        store.match_prefix("fp", op[2], namespace=ns)
    elif kind == "contains":
        store.contains(op[2], ns)
    else:
        getattr(store, kind)(op[2], namespace=ns)
    return []


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ops, max_size=60), st.sampled_from([None, 600]), st.sampled_from([None, 2.0]))
def test_random_sequences_keep_every_invariant(sequence, namespace_budget_bytes, idle_s):
    store = KVStore(BUDGET_BYTES, block_len=2, namespace_budget_bytes=namespace_budget_bytes,
                    namespace_idle_s=idle_s, clock=Clock())
    pins: dict[tuple[str, str], int] = {}  # the model: pin counts of live spans
    for op in sequence:
        before = {ns: set(store.ids(ns)) for ns in NAMESPACES}
        try:
            evicted = apply(store, op)
        except KvRelayError:
            evicted = None
            after = {ns: set(store.ids(ns)) for ns in NAMESPACES}
            if op[0] == "put":
                assert after == before  # a refused put changes nothing
        else:
            key = (op[1], op[2]) if op[0] != "match" else None
            if op[0] == "put":
                pins[key] = pins.get(key, 0) + op[4]
            elif op[0] == "pin":
                pins[key] += 1
            elif op[0] == "unpin":
                pins[key] -= 1
            elif op[0] == "remove":
                pins.pop(key)
        for ns in NAMESPACES:
            if evicted is not None and op[0] == "put" and ns != op[1]:
                assert set(store.ids(ns)) == before[ns]  # another namespace's put never evicts here
        for sid in evicted or ():
            assert pins.pop((op[1], sid)) == 0  # never a pinned span
        reclaimed = store.take_reclaimed()
        for ns, sid in [key for key in pins if key[1] not in store.ids(key[0])]:  # gone with an expired namespace
            assert idle_s is not None and sid in reclaimed and store.ids(ns) == [] and pins.pop((ns, sid)) == 0
        for (ns, sid), n in pins.items():  # ids() and is_pinned() never count as a use of the namespace
            assert sid in store.ids(ns) and store.is_pinned(sid, ns) == (n > 0)
        store.check_invariants()
        assert store.peak_bytes <= BUDGET_BYTES


def hammer(store: KVStore, num_threads: int, num_ops_per_thread: int, seed: int) -> tuple[list, int]:
    """Threads doing random operations on one store; a watcher checks the invariants meanwhile.

    Returns (unexpected exceptions, budget violations seen by the watcher).
    """
    errors: list[BaseException] = []
    violations = [0]
    done = threading.Event()
    for i in range(4):  # pinned by nobody but here: must survive everything
        store.put(f"pinned{i}", Toy(50), pin=True, namespace=NAMESPACES[i % 3])

    def worker(k: int) -> None:
        rng = random.Random(seed * 100 + k)
        for _ in range(num_ops_per_thread):
            ns, sid = rng.choice(NAMESPACES), f"s{rng.randrange(12)}"
            kind = rng.choice(["put", "put", "get", "remove", "pin", "unpin", "match", "contains"])
            op = (kind, ns, sid, rng.randrange(300), rng.random() < 0.1) if kind == "put" else \
                (kind, ns, [rng.randrange(4) for _ in range(6)]) if kind == "match" else (kind, ns, sid)
            try:
                apply(store, op)
            except KvRelayError:
                pass
            except BaseException as e:  # noqa: BLE001 - exactly what the test looks for
                errors.append(e)

    def watcher() -> None:
        while not done.is_set():
            if store.used_bytes > store.budget_bytes:
                violations[0] += 1
            try:
                store.check_invariants()
            except AssertionError:
                violations[0] += 1
            except Exception as e:  # noqa: BLE001 - e.g. a dict mutated while the check reads it
                errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(num_threads)]
    watch = threading.Thread(target=watcher)
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show up quickly
    try:
        watch.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        done.set()
        watch.join()
        sys.setswitchinterval(old_interval)
    for i in range(4):
        assert store.is_pinned(f"pinned{i}", NAMESPACES[i % 3])
    return errors, violations[0]


@pytest.mark.parametrize("idle_s", [None, 1e-4])  # 1e-4 s: namespaces expire all the time
@pytest.mark.parametrize("num_threads", [2, 8])
def test_threads_hammering_one_store(num_threads, idle_s):
    store = KVStore(BUDGET_BYTES, block_len=2, namespace_idle_s=idle_s)
    errors, violations = hammer(store, num_threads, 16_000 // num_threads, seed=num_threads)
    assert errors == [] and violations == 0
    store.check_invariants()
    assert store.peak_bytes <= BUDGET_BYTES


@settings(max_examples=10, deadline=None)
@given(st.lists(st.lists(ops, max_size=40), min_size=2, max_size=4))
def test_random_sequences_on_threads(per_thread):
    store = KVStore(BUDGET_BYTES, block_len=2)
    errors: list[BaseException] = []

    def run(sequence: list) -> None:
        for op in sequence:
            try:
                apply(store, op)
            except KvRelayError:
                pass
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

    threads = [threading.Thread(target=run, args=(seq,)) for seq in per_thread]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    store.check_invariants()


# ---------------------------------------------------------------------- input checks
@pytest.mark.parametrize("bad, match", [
    (Toy(-1), "nbytes must be a non-negative int"),
    (Toy(True), "nbytes must be a non-negative int"),
    (Toy(10.5), "nbytes must be a non-negative int"),
    (Toy(10, token_ids=(1, "2")), "token_ids must be a tuple of non-negative ints"),
    (Toy(10, token_ids=(1, -2)), "token_ids must be a tuple of non-negative ints"),
    (Toy(10, start_pos=-1), "start_pos must be a non-negative int"),
    (Toy(10, fingerprint=None), "fingerprint must be a string"),
])
def test_put_rejects_bad_spans_and_changes_nothing(bad, match):
    store = KVStore(100)
    store.put("ok", Toy(40))
    with pytest.raises(KvRelayError, match=match):
        store.put("bad", bad)
    assert store.ids() == ["ok"] and store.used_bytes == 40


def test_put_rejects_bad_ids_and_namespaces():
    store = KVStore(100)
    with pytest.raises(KvRelayError, match="span id must be a non-empty string"):
        store.put("", Toy(1))
    with pytest.raises(KvRelayError, match="namespace must be a string"):
        store.put("a", Toy(1), namespace=None)
    with pytest.raises(KvRelayError, match="budget must be a positive int"):
        KVStore(-5)


def test_namespaces_are_isolated():
    store = KVStore(100)
    store.put("a", Toy(60, (1, 2, 3, 4) * 8), namespace="t1")
    assert "a" not in store and not store.contains("a", "t2") and store.match_prefix("fp", (1, 2, 3, 4) * 8) is None
    with pytest.raises(SpanNotFoundError):
        store.get("a", namespace="t2")
    with pytest.raises(StoreFullError, match="60 bytes belong to other namespaces"):
        store.put("b", Toy(60), namespace="t2")  # never evicts t1's span
    assert store.view("t1").match_prefix("fp", (1, 2, 3, 4) * 8).num_tokens == 32
    store.put("a", Toy(30))  # the same id in the default namespace is another span
    assert store.get("a", "t1").nbytes == 60 and store.get("a").nbytes == 30


def test_namespace_budget_caps_one_tenant():
    store = KVStore(100, namespace_budget_bytes=50)
    store.put("a", Toy(30), namespace="t1")
    assert store.put("b", Toy(30), namespace="t1") == ["a"]
    store.put("c", Toy(50), namespace="t2")
    assert store.used_bytes == 80
