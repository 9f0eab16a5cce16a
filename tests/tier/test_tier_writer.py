"""The tier writer: a put returns while the tier write it owes is held up; the writer writes it, oldest first, what is
still in memory then; a down tier leaves what is owed for later; ``stop`` writes what it can within its time."""

from __future__ import annotations

import threading

import torch

from kvrelay.cache.store import KVStore
from kvrelay.tier.backends.base import span_key
from kvrelay.tier.backends.disk import DiskBackend
from kvrelay.tier.tiered import TieredStore
from kvrelay.tier.writer import TierWriter
from tests.tier.test_tier_prober import _written, hanging_store
from tests.tier.test_tiered import span

WAIT_S = 30.0  # a bound on a wait that ends at once unless something is broken


class HeldBackend(DiskBackend):
    """A disk tier whose writes wait until ``release`` (a slow or paused tier), recording the keys in write order."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.released = threading.Event()
        self.writing = threading.Event()
        self.keys: list[str] = []

    def put(self, key: str, value: bytes, meta: bytes) -> None:
        self.writing.set()
        assert self.released.wait(WAIT_S)
        self.keys.append(key)
        super().put(key, value, meta)


def test_a_put_returns_while_its_tier_write_is_held_and_the_writer_writes_it(tmp_path):
    backend = HeldBackend(tmp_path)
    store = TieredStore(1 << 20, backend, "fp")
    writer = TierWriter(store)
    writer.start()
    first, second = span(20), span(21)
    store.put("a", first)  # returns: the writer, not this thread, waits on the tier
    assert backend.writing.wait(WAIT_S)
    store.put("b", second)
    store.put("c", span(22))
    assert KVStore.contains(store, "a") and KVStore.contains(store, "b") and store.num_unwritten == 3
    reader = TieredStore(1 << 20, DiskBackend(tmp_path), "fp")
    assert "a" not in reader  # not in the tier until written
    backend.released.set()
    assert writer.wait_written(WAIT_S) and store.num_unwritten == 0
    assert backend.keys == [span_key("", "fp", sid) for sid in "abc"]  # oldest first
    assert torch.equal(reader.get("a").k, first.k) and torch.equal(reader.get("b").k, second.k)
    assert writer.stop() and store.writer is None


def test_writes_go_oldest_first_and_a_span_evicted_before_its_turn_is_not_written(tmp_path):
    backend = HeldBackend(tmp_path)
    first, second, third, fourth = span(20), span(21), span(22), span(23)
    store = TieredStore(third.nbytes + fourth.nbytes + 8, backend, "fp")  # room for the last two, not three
    writer = TierWriter(store)
    writer.start()
    store.put("a", first)
    assert backend.writing.wait(WAIT_S)  # "a" is being written
    store.put("b", second)  # "a" and "b" fit
    store.put("c", third)  # evicts "a" (being written: the writer holds its own reference) ...
    store.put("d", fourth)  # ... and "b", owed but not yet written: it is not written
    backend.released.set()
    assert writer.wait_written(WAIT_S)
    reader = TieredStore(1 << 20, DiskBackend(tmp_path), "fp")
    assert "a" in reader and "b" not in reader and "c" in reader and "d" in reader
    assert len(backend.keys) == 3
    writer.stop()


def test_a_down_tier_costs_the_putting_thread_nothing_and_what_is_owed_is_written_once_it_is_back():
    store, backend, steps = hanging_store()
    writer = TierWriter(store)
    writer.start()
    backend.hung.set()
    store.put("p0", span(20))  # the writer's call meets the outage and marks the tier down
    assert writer.wait_written(WAIT_S) and not store.health.up
    for i in range(1, 4):
        store.put(f"p{i}", span(20 + i))
    assert writer.wait_written(WAIT_S) and store.num_unwritten == 4  # kept for the tier, no call made
    assert backend.calls["put"] == 1
    backend.hung.clear()
    steps.step()  # the prober finds it back
    assert backend.probes.get(timeout=WAIT_S) is True
    store.health.probe_thread.join(WAIT_S)
    store.put("after", span(50))  # the next put after it is back: every span owed is written
    assert writer.wait_written(WAIT_S) and store.num_unwritten == 0
    assert _written(backend) == [f"p{i}" for i in range(4)] + ["after"]
    writer.stop()
    store.close()


def test_stop_writes_what_is_owed_within_its_time_and_hands_writes_back(tmp_path):
    backend = HeldBackend(tmp_path)
    store = TieredStore(1 << 20, backend, "fp")
    writer = TierWriter(store)
    writer.start()
    store.put("a", span(20))
    assert backend.writing.wait(WAIT_S)
    assert not writer.stop(timeout_s=0.0)  # held: not written in the time given
    assert store.writer is None and store.num_unwritten == 1
    backend.released.set()
    store.put("b", span(21))  # written on this thread again, with what was owed
    assert store.num_unwritten == 0
    reader = TieredStore(1 << 20, DiskBackend(tmp_path), "fp")
    assert "a" in reader and "b" in reader
