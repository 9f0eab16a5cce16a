"""Wire format, disk backend, cost model and tiered-store logic (fakeredis / a temp dir; no server)."""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path

import fakeredis
import pytest
import torch

from kvrelay.cache.kv import StoredSpan
from kvrelay.cache.store import KVStore
from kvrelay.errors import ConfigError
from kvrelay.tier.backends.base import redact, span_key
from kvrelay.tier.backends.disk import DiskBackend
from kvrelay.tier.backends.redis import RedisBackend
from kvrelay.tier.fetch_cost import _EWMA_ALPHA, FetchCostModel
from kvrelay.tier.tiered import TieredStore, open_store
from kvrelay.tier.wire import WireError, decode_span, encode_span


def span(n: int = 20, fp: str = "fp", dtype: torch.dtype = torch.float32, start_pos: int = 0) -> StoredSpan:
    g = torch.Generator().manual_seed(n)
    k = torch.randn(3, 2, n, 8, generator=g).to(dtype)
    hidden = {1: torch.randn(n - 4, 16, generator=g).to(dtype)}
    return StoredSpan(tuple(range(100, 100 + n)), start_pos, k, -k, fp, hidden, hidden_from=4)


def fake_backend() -> RedisBackend:
    return RedisBackend("redis://fake", client=fakeredis.FakeRedis())


# ---------------------------------------------------------------------- wire
@pytest.mark.parametrize("buffer", [bytes, bytearray])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_wire_round_trip_is_exact(dtype, buffer):
    s = span(dtype=dtype, start_pos=5)
    value, meta = encode_span(s, "a", "ns")
    back = decode_span(buffer(value), "a", "ns", "fp")
    assert back.token_ids == s.token_ids and back.start_pos == 5 and back.hidden_from == 4
    assert back.k.dtype == dtype and torch.equal(back.k, s.k) and torch.equal(back.v, s.v)
    assert torch.equal(back.hidden[1], s.hidden[1])
    assert (meta.num_tokens, meta.num_layers, meta.value_bytes) == (20, 3, len(value))


@pytest.mark.parametrize("buffer", [bytes, bytearray])
def test_wire_rejects_every_truncation_and_bit_flip(buffer):
    value, _ = encode_span(span(6), "a", "")
    for cut in range(0, len(value), 7):
        with pytest.raises(WireError):
            decode_span(buffer(value[:cut]), "a", "", "fp")
    for pos in range(0, len(value), 11):
        bad = bytearray(value)
        bad[pos] ^= 0x40
        with pytest.raises(WireError):
            decode_span(buffer(bad), "a", "", "fp")


@pytest.mark.parametrize("asked", [("b", "", "fp"), ("a", "other", "fp"), ("a", "", "other-model")])
def test_wire_rejects_another_span_namespace_or_model(asked):
    value, _ = encode_span(span(), "a", "")
    with pytest.raises(WireError, match="value holds span"):
        decode_span(value, *asked)


# ---------------------------------------------------------------------- disk backend
def test_disk_span_survives_a_restart(tmp_path):
    TieredStore(1 << 20, DiskBackend(tmp_path), "fp").put("a", span())
    fresh = open_store(f"disk:{tmp_path}", 1 << 20, fingerprint="fp")  # a new process, in effect
    assert "a" in fresh and torch.equal(fresh.get("a").v, span().v)
    assert [p.span_id for p in fresh.poll_published()] == ["a"]


def test_a_deferred_write_is_owed_even_if_memory_evicts_the_span_first(tmp_path):
    first, second = span(20), span(21)
    store = TieredStore(second.nbytes + 8, DiskBackend(tmp_path), "fp")  # room for one span at a time
    with store.writes_deferred():
        store.put("a", first)
        store.put("b", second)  # evicts "a" from memory before its tier write
    assert not KVStore.contains(store, "a")  # evicted from memory, not yet in the tier
    assert store.flush_unwritten() == 2
    reader = TieredStore(1 << 20, DiskBackend(tmp_path), "fp")
    assert torch.equal(reader.get("a").k, first.k) and torch.equal(reader.get("b").k, second.k)


def test_disk_readers_never_see_a_partial_write(tmp_path):
    spans = [span(4000), span(3000)]  # ~0.4 and ~0.3 MB values, rewritten under one key
    writer = TieredStore(1 << 24, DiskBackend(tmp_path), "fp")
    reader = TieredStore(1 << 24, DiskBackend(tmp_path), "fp")
    writer.put("a", spans[0])
    stop = threading.Event()

    def rewrite() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            writer.put("a", spans[i % 2])

    t = threading.Thread(target=rewrite)
    t.start()
    try:
        for _ in range(60):
            got = reader.get("a")
            assert any(torch.equal(got.k, s.k) for s in spans)
            reader.remove("a")
    finally:
        stop.set()
        t.join()
    assert all(d.action == "fetch" for d in reader.take_decisions())


def test_disk_failed_write_leaves_no_file(tmp_path, monkeypatch):
    backend = DiskBackend(tmp_path)
    store = TieredStore(1 << 20, backend, "fp")
    store.put("old", span(8))

    def crash(*_args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    store.put("new", span(9))  # the tier write fails: no partial file, the span stays in memory
    monkeypatch.undo()
    assert sorted(p.name for p in Path(tmp_path).iterdir() if not p.name.endswith(".log")) == sorted(
        [span_key("", "fp", "old") + ".m", span_key("", "fp", "old") + ".v"])
    assert "new" in store
    reader = TieredStore(1 << 20, DiskBackend(tmp_path), "fp")
    assert "new" not in reader and "old" in reader


def test_disk_removes_temporaries_of_killed_writers_only(tmp_path):
    stale, live = tmp_path / ".tmp-stale", tmp_path / ".tmp-live"
    stale.write_bytes(b"half a span")
    live.write_bytes(b"being written")
    os.utime(stale, (0, 0))
    DiskBackend(tmp_path)
    assert not stale.exists() and live.exists()


def test_disk_corrupt_file_is_a_miss_with_a_warning(tmp_path, caplog):
    TieredStore(1 << 20, DiskBackend(tmp_path), "fp").put("a", span())
    path = tmp_path / (span_key("", "fp", "a") + ".v")
    path.write_bytes(path.read_bytes()[:-1])
    reader = TieredStore(1 << 20, DiskBackend(tmp_path), "fp")
    with caplog.at_level(logging.WARNING, logger="kvrelay.tier"):
        assert "a" not in reader
    assert "checksum" in caplog.text and reader.take_decisions()[0].reason == "corrupt value"
    (tmp_path / (span_key("", "fp", "a") + ".m")).write_bytes(b"{not json")
    assert "a" not in reader and reader.take_decisions()[0].reason == "a bad record, skipped"  # not read again
    fresh = TieredStore(1 << 20, DiskBackend(tmp_path), "fp")  # another process reads the metadata first
    assert "a" not in fresh and fresh.take_decisions()[0].reason == "corrupt metadata"


def test_disk_unwritable_directory_is_a_clear_error(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="cannot be created"):
        open_store(f"disk:{tmp_path}/f/sub", 1000)


# ---------------------------------------------------------------------- cost model and decisions
class Clock:
    """A clock that moves only when the test, or a backend read it slows (``slowed``), says."""

    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def slowed(backend: RedisBackend, clock: Clock, meta_s: float, value_s: float) -> RedisBackend:
    """``backend`` whose metadata reads take ``meta_s`` and value reads ``value_s`` on ``clock``."""
    get_meta, get_value = backend.get_meta, backend.get_value

    def meta(key: str) -> bytes | None:
        clock.now_s += meta_s
        return get_meta(key)

    def value(key: str) -> bytes | None:
        clock.now_s += value_s
        return get_value(key)

    backend.get_meta, backend.get_value = meta, value
    return backend


def test_cost_model_fetches_only_when_it_pays():
    backend = fake_backend()
    TieredStore(1 << 24, backend, "fp").put("a", span(200))
    clock = Clock()
    meta_s, value_s = 0.5e-3, 4e-3
    store = TieredStore(1 << 24, slowed(backend, clock, meta_s, value_s), "fp", clock=clock)
    store.cost.observe_latency(1e-3)
    store.cost.observe_fetch(1_000_000, 1e-3 + 1e-2)  # 100 MB/s
    store.set_compute_rate(1e12)  # recompute is free: do not fetch
    assert "a" not in store
    (d,) = store.take_decisions()
    value_bytes = d.value_bytes
    assert d.action == "recompute" and d.num_tokens == 200 and d.num_layers == 3
    assert d.est_recompute_ms == pytest.approx(200 * 3 / 1e12 * 1e3)
    latency_s = (1 - _EWMA_ALPHA) * 1e-3 + _EWMA_ALPHA * meta_s  # the meta read moved the running average
    assert d.tier_bytes_per_s == pytest.approx(1e8) and d.tier_latency_ms == pytest.approx(latency_s * 1e3)
    assert d.est_fetch_ms == pytest.approx(d.tier_latency_ms + value_bytes / 1e8 * 1e3)
    store.set_compute_rate(1.0)  # one token-layer per second: fetching pays
    assert "a" in store
    (d,) = store.take_decisions()
    assert d.action == "fetch" and d.fetch_ms == pytest.approx(value_s * 1e3) and d.compute_token_layers_per_s == 1.0
    latency_s = (1 - _EWMA_ALPHA) * latency_s + _EWMA_ALPHA * meta_s
    assert d.tier_latency_ms == pytest.approx(latency_s * 1e3)
    rate = value_bytes / (value_s - latency_s)  # the fetch's transfer: its time less the round trip
    assert store.cost.tier_bytes_per_s == pytest.approx((1 - _EWMA_ALPHA) * 1e8 + _EWMA_ALPHA * rate)


def test_decisions_are_per_thread():
    backend = fake_backend()
    TieredStore(1 << 24, backend, "fp").put("a", span())
    store = TieredStore(1 << 24, backend, "fp")
    other: list = []
    t = threading.Thread(target=lambda: (store.contains("zzz"), other.extend(store.take_decisions())))
    t.start()
    t.join()
    assert "a" in store
    assert [d.span_id for d in store.take_decisions()] == ["a"] and [d.span_id for d in other] == ["zzz"]
    assert store.take_decisions() == []


def test_fetch_that_does_not_fit_the_memory_budget_is_a_recompute():
    backend = fake_backend()
    TieredStore(1 << 24, backend, "fp").put("big", span(50))
    small = TieredStore(1000, backend, "fp")
    assert "big" not in small and small.used_bytes == 0
    assert small.take_decisions()[0].reason == "no room in the memory tier"


def test_compute_rate_must_be_positive():
    with pytest.raises(ValueError):
        FetchCostModel().set_compute_rate(0.0)


# ---------------------------------------------------------------------- tiered store semantics
def test_get_and_pin_fetch_a_span_only_the_tier_has():
    backend = fake_backend()
    TieredStore(1 << 24, backend, "fp").put("a", span())
    store = TieredStore(1 << 24, backend, "fp")
    store.pin("a")
    assert store.is_pinned("a") and torch.equal(store.get("a").k, span().k)
    with pytest.raises(KeyError):
        store.get("never")


def test_remove_frees_memory_only_and_delete_from_tier_removes_it():
    backend = fake_backend()
    store = TieredStore(1 << 24, backend, "fp")
    store.put("a", span())
    store.remove("a")
    assert store.used_bytes == 0 and "a" in store  # fetched back
    store.remove("a")
    assert store.delete_from_tier("a") and "a" not in store


def test_announcements_skip_own_spans_unless_asked():
    backend = fake_backend()
    a, b = TieredStore(1 << 24, backend, "fp"), TieredStore(1 << 24, backend, "fp")
    a.put("x", span())
    assert a.poll_published() == [] and [p.span_id for p in b.poll_published()] == ["x"]
    assert [p.span_id for p in TieredStore(1 << 24, backend, "fp").poll_published(include_own=True)] == ["x"]


def test_open_store_urls():
    assert type(open_store(None, 100)) is KVStore and type(open_store("memory", 100)) is KVStore
    with pytest.raises(ConfigError, match="disk:PATH"):
        open_store("disk:", 100)
    with pytest.raises(ConfigError, match="unknown store 'ftp://\\*\\*\\*@h'"):
        open_store("ftp://u:pw@h", 100)


def test_redact():
    assert redact("redis://user:pw@host:6379/0") == "redis://***@host:6379/0"
    assert redact("redis://:pw@host/0") == "redis://***@host/0"
    assert redact("redis://host:6379/0?password=pw&db=1") == "redis://host:6379/0?password=***&db=1"
    assert redact("disk:/tmp/x") == "disk:/tmp/x" and redact(None) == "memory"


def test_a_namespace_view_reaches_the_tier_and_its_decisions():
    backend = fake_backend()
    TieredStore(1 << 24, backend, "fp").view("t").put("a", span())
    view = TieredStore(1 << 24, backend, "fp").view("t")
    view.set_compute_rate(1.0)
    assert "a" in view and [p.span_id for p in view.poll_published()] == ["a"]
    assert [(d.span_id, d.namespace, d.action) for d in view.take_decisions()] == [("a", "t", "fetch")]
    assert KVStore(10).view("t").take_decisions() == []


def test_threads_on_one_tiered_store(tmp_path):
    """The memory tier's guarantees hold with the tier behind it: budget, pins, no stray errors."""
    import random

    from kvrelay.errors import KvRelayError

    spans = [span(n) for n in range(4, 12)]
    budget_bytes = 3 * max(s.nbytes for s in spans)
    store = TieredStore(budget_bytes, DiskBackend(tmp_path), "fp")
    store.put("pinned", spans[0], pin=True)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(500):
            sid, ns = f"s{rng.randrange(6)}", rng.choice(["", "t"])
            try:
                kind = rng.randrange(4)
                if kind == 0:
                    store.put(sid, rng.choice(spans), namespace=ns)
                elif kind == 1:
                    store.contains(sid, ns)
                elif kind == 2:
                    store.get(sid, ns)
                else:
                    store.remove(sid, ns)
                assert store.used_bytes <= budget_bytes
            except KvRelayError:
                pass
            except BaseException as e:  # noqa: BLE001 - what the test looks for
                errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show up quickly
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old_interval)
    assert errors == [] and store.is_pinned("pinned")
    store.check_invariants()


def test_match_prefix_finds_a_prefix_another_process_published():
    backend = fake_backend()
    TieredStore(1 << 24, backend, "fp").put("p", span(20))  # tokens 100..119 at position 0
    b = TieredStore(1 << 24, backend, "fp", remote_prefix_poll_s=0.0)
    query = list(range(100, 117)) + [1, 2]
    m = b.match_prefix("fp", query)
    assert (m.span_id, m.num_tokens) == ("p", 17) and "p" in b.ids()  # fetched into memory
    assert [d.action for d in b.take_decisions()] == ["fetch"]
    assert [p.span_id for p in b.poll_published()] == ["p"]  # the index still gets the announcement
    assert b.match_prefix("fp", query, namespace="t") is None and b.match_prefix("other", query) is None
    assert TieredStore(1 << 24, backend, "fp", remote_prefix_poll_s=None).match_prefix("fp", query) is None


def test_a_remote_prefix_gone_from_the_tier_is_forgotten():
    backend = fake_backend()
    a = TieredStore(1 << 24, backend, "fp")
    a.put("p", span(20))
    a.delete_from_tier("p")
    b = TieredStore(1 << 24, backend, "fp", remote_prefix_poll_s=0.0)
    query = list(range(100, 120))
    assert b.match_prefix("fp", query) is None and b.remote.match("fp", query, "") is None
    assert b.take_decisions()[0].reason == "not in the tier"
