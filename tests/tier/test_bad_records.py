"""A bad record in the shared tier is skipped and counted, never the tier's end: a disk log line that does not decode,
a Redis stream entry that is not an announcement, metadata or a value that is not a span. Every other record is still
read, new spans are still written, intact spans are still fetched (a real directory, fakeredis, a real redis-server).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import struct

import fakeredis
import pytest
import torch

from kvrelay.cache.kv import StoredSpan
from kvrelay.cache.store import SpanNotFoundError
from kvrelay.tier.backends.base import channel_key, span_key
from kvrelay.tier.backends.disk import DiskBackend
from kvrelay.tier.backends.redis import PREFIX, RedisBackend
from kvrelay.tier.bad_records import BadRecords
from kvrelay.tier.tiered import TieredStore
from kvrelay.tier.wire import MAGIC


def span(n: int) -> StoredSpan:
    k = torch.randn(2, 2, n, 4, generator=torch.Generator().manual_seed(n))
    return StoredSpan(tuple(range(100, 100 + n)), 0, k, -k, "fp")


def _two_disk_stores(tmp_path) -> tuple[TieredStore, TieredStore]:
    return TieredStore(1 << 22, DiskBackend(tmp_path), "fp"), TieredStore(1 << 22, DiskBackend(tmp_path), "fp")


def _disk(tmp_path):
    def new_store() -> TieredStore:  # each a process of its own, in effect
        return TieredStore(1 << 22, DiskBackend(tmp_path), "fp")

    def plant(raw_lines: list[bytes]) -> None:
        with open(tmp_path / (channel_key("", "fp") + ".log"), "ab") as f:
            f.write(b"".join(line + b"\n" for line in raw_lines))

    # a line that is not base64, one that is but holds no JSON, one whose JSON is no announcement
    return new_store, plant, [b"!!! not base64 !!!", base64.b64encode(b"not json"),
                              base64.b64encode(json.dumps({"span_id": "q"}).encode())]


def _redis(client_of):
    def new_store() -> TieredStore:
        return TieredStore(1 << 22, RedisBackend("redis://test", client=client_of()), "fp")

    def plant(fields_list: list[dict]) -> None:
        for fields in fields_list:
            client_of().xadd(PREFIX + channel_key("", "fp"), fields)

    # an entry without the message field, one whose message is no JSON, one whose JSON is no announcement
    return new_store, plant, [{b"other": b"1"}, {b"m": b"not json"}, {b"m": json.dumps([1, 2]).encode()}]


@pytest.fixture(params=["disk", "fakeredis", "redis-server"])
def tier(request, tmp_path):
    if request.param == "disk":
        return _disk(tmp_path)
    if request.param == "fakeredis":
        server = fakeredis.FakeServer()
        return _redis(lambda: fakeredis.FakeRedis(server=server))
    import redis

    url = request.getfixturevalue("redis_url")  # tests/tier/conftest.py: a real redis-server, emptied
    return _redis(lambda: redis.Redis.from_url(url, socket_timeout=2))


def test_bad_announcements_are_skipped_and_counted_and_the_tier_goes_on(tier):
    new_store, plant, bad = tier
    writer = new_store()
    writer.put("x", span(20))
    plant(bad)
    writer.put("y", span(24))
    reader = new_store()
    assert [p.span_id for p in reader.poll_published()] == ["x", "y"]  # the records around the bad ones
    assert reader.bad_records == {"announcement": 3, "metadata": 0, "value": 0}
    assert reader.health.down_since is None and reader.health.num_failures == 0  # not taken for an outage
    assert "y" in reader and torch.equal(reader.get("y").k, span(24).k)  # an intact span is fetched
    reader.put("z", span(28))  # and new spans are still written and announced
    assert "z" in new_store() and [p.span_id for p in writer.poll_published()] == ["z"]
    plant(bad[:1])
    writer.put("w", span(30))
    assert [p.span_id for p in reader.poll_published()] == ["w"]  # past the bad records: never read twice
    assert reader.bad_records["announcement"] == 4


def test_the_disk_log_replaced_under_a_reader_is_read_from_its_start(tmp_path):
    writer, reader = _two_disk_stores(tmp_path)
    for i, n in enumerate((20, 21, 22)):
        writer.put(f"s{i}", span(n))
    assert len(reader.poll_published()) == 3
    (tmp_path / (channel_key("", "fp") + ".log")).unlink()  # an operator clears the log
    writer.put("after", span(23))
    assert [p.span_id for p in reader.poll_published()] == ["after"]


@pytest.mark.parametrize("kind", ["metadata", "value"])
def test_a_bad_metadata_or_value_record_is_a_counted_miss(tmp_path, kind):
    writer, reader = _two_disk_stores(tmp_path)
    writer.put("bad", span(20))
    writer.put("good", span(21))
    suffix = ".m" if kind == "metadata" else ".v"
    (tmp_path / (span_key("", "fp", "bad") + suffix)).write_bytes(b"{not a record")
    assert "bad" not in reader
    assert reader.bad_records[kind] == 1 and reader.health.down_since is None
    assert "good" in reader


def test_a_forged_value_that_passes_the_checksum_is_a_counted_miss(tmp_path):
    """The checksum catches corruption, not a writer of another format: such a value's header is checked too."""
    writer, reader = _two_disk_stores(tmp_path)
    for sid, header in (("a", b"[1, 2]"), ("b", json.dumps({"span_id": "b", "namespace": "", "fingerprint": "fp"})),
                        ("c", json.dumps({"span_id": "c", "namespace": "", "fingerprint": "fp", "payload_bytes": 0,
                                          "tensors": [{"name": "k", "dtype": "float32", "shape": [-3], "offset": 0,
                                                       "nbytes": 0}]}))):
        writer.put(sid, span(20))
        header = header if isinstance(header, bytes) else header.encode()
        body = MAGIC + struct.pack("<I", len(header)) + header
        (tmp_path / (span_key("", "fp", sid) + ".v")).write_bytes(body + hashlib.sha256(body).digest())
        assert sid not in reader
    assert reader.bad_records["value"] == 3


def test_a_chunk_count_that_cannot_be_one_asks_for_no_keys():
    server = fakeredis.FakeServer()
    writer = TieredStore(1 << 22, RedisBackend("redis://test", client=fakeredis.FakeRedis(server=server)), "fp")
    writer.put("a", span(20))
    fakeredis.FakeRedis(server=server).set(PREFIX + span_key("", "fp", "a") + ":v", b"KVRCHUNK" + b"9" * 12)
    reader = TieredStore(1 << 22, RedisBackend("redis://test", client=fakeredis.FakeRedis(server=server)), "fp")
    assert "a" not in reader and reader.bad_records["value"] == 1



def test_a_bad_value_is_counted_warned_and_read_once_however_often_it_is_looked_up(caplog):
    server = fakeredis.FakeServer()
    writer = TieredStore(1 << 22, RedisBackend("redis://test", client=fakeredis.FakeRedis(server=server)), "fp")
    writer.put("a", span(20))
    writer.put("b", span(21))
    fakeredis.FakeRedis(server=server).set(PREFIX + span_key("", "fp", "a") + ":v", b"garbage")
    backend = RedisBackend("redis://test", client=fakeredis.FakeRedis(server=server))
    reads: list[str] = []
    get_value = backend.get_value
    backend.get_value = lambda key: reads.append(key) or get_value(key)
    reader = TieredStore(1 << 22, backend, "fp")
    with caplog.at_level(logging.WARNING, logger="kvrelay.tier"):
        for _ in range(3):  # a continuation looks the span up more than once
            assert "a" not in reader
        with pytest.raises(SpanNotFoundError):
            reader.get("a")
    assert reader.bad_records["value"] == 1 and len(reads) == 1
    (warning,) = [r.getMessage() for r in caplog.records if "skipped from now on" in r.getMessage()]
    assert f"(span {span_key('', 'fp', 'a')}, value)" in warning  # the record an operator would delete
    assert [d.reason for d in reader.take_decisions()] == ["corrupt value"] + ["a bad record, skipped"] * 3
    assert "b" in reader and len(reads) == 2  # other records are read as ever
    reader.put("a", span(20))  # written anew by this process: read again
    reader.remove("a")
    assert "a" in reader and reader.bad_records["value"] == 1


def test_bad_keys_are_remembered_up_to_the_bound():
    bad = BadRecords("fake://", max_keys=2)
    for key in ("k1", "k2", "k3"):
        bad.add(key, "value", "planted")
    bad.add("k3", "value", "planted")  # known: not counted again
    assert bad.num_by_kind == {"metadata": 0, "value": 3}
    assert [bad.known(k) for k in ("k1", "k2", "k3")] == [False, True, True]  # the oldest forgotten first
    bad.add("k1", "metadata", "planted")  # forgotten, so found and counted anew
    assert bad.num_by_kind == {"metadata": 1, "value": 3} and not bad.known("k2")


def test_the_server_exports_the_count(tmp_path):
    from kvrelay.server.metrics import ServerMetrics

    writer, reader = _two_disk_stores(tmp_path)
    writer.put("x", span(20))
    _disk(tmp_path)[1]([b"@@@"])
    metrics = ServerMetrics()
    for expected in (0, 1, 1):  # counted once, however often the store is observed
        metrics.observe_store(reader)
        assert metrics.registry.get_sample_value("kvrelay_tier_bad_records_total", {"kind": "announcement"}) == expected
        reader.poll_published()
