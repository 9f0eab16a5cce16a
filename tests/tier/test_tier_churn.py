"""A replica on a shared tier that serves for weeks: tenants that come and go (a ``cache_salt`` per conversation)
and the spans its peers publish leave bounded state behind (the channels it polls, the spans it learned)."""

import torch

from kvrelay.cache.kv import StoredSpan
from kvrelay.server.catalog import MatchConfig, SpanCatalog
from kvrelay.tier.tiered import TieredStore, open_store
from tests.retained import MAX_BOUNDED_BYTES_PER_CALL, retained_bytes_per_call


def _span(token_ids: tuple[int, ...]) -> StoredSpan:
    k = torch.randn(2, 1, len(token_ids), 4, generator=torch.Generator().manual_seed(len(token_ids)))
    return StoredSpan(token_ids, 0, k, k + 1, "fp")


def test_polling_a_new_namespace_each_time_keeps_a_bounded_number_of_channels(tmp_path):
    store = open_store(f"disk:{tmp_path / 'tier'}", 1 << 20, fingerprint="fp")
    assert isinstance(store, TieredStore)
    store.max_polled_channels = 16

    def conversation(i: int) -> None:
        namespace = f"k0/s{i:08d}"
        store.poll_published(namespace)
        store.match_prefix("fp", [1, 2, 3, 4, 5, 6, 7, 8], namespace)

    assert retained_bytes_per_call(conversation) <= MAX_BOUNDED_BYTES_PER_CALL
    assert store.num_polled_channels == 16 and store.remote.num_channels == 0


def test_a_forgotten_channel_drops_what_waits_on_it(tmp_path):
    url = f"disk:{tmp_path / 'tier'}"
    publisher = open_store(url, 1 << 24, fingerprint="fp")
    reader = open_store(url, 1 << 24, fingerprint="fp")
    reader.remote_prefix_poll_s, reader.max_polled_channels = 0.0, 2
    publisher.put("a", _span(tuple(range(10, 18))), namespace="team")
    reader.match_prefix("fp", list(range(10, 18)), "team")  # reads the announcement, queued for poll_published
    assert reader.remote.num_channels == 1
    for other in ("x", "y"):
        reader.poll_published(other)
    assert reader.num_polled_channels == 2 and reader.remote.num_channels == 0
    assert [p.span_id for p in reader.poll_published("team")] == ["a"]  # read again from the channel's start


def test_spans_learned_from_peers_are_bounded_in_the_index(tmp_path):
    url = f"disk:{tmp_path / 'tier'}"
    match = MatchConfig(min_match_tokens=4)
    peer = SpanCatalog(open_store(url, 1 << 24, fingerprint="fp"), "fp", block_len=4, match=match)
    replica = SpanCatalog(open_store(url, 1 << 24, fingerprint="fp"), "fp", block_len=4, match=match,
                          max_learned_tokens=5 * 8)
    for i in range(40):
        namespace = f"k0/s{i:08d}"
        peer.put(namespace, peer.new_span_id(), _span(tuple(range(100 + i, 108 + i))))
        assert replica.learn_published(namespace) == 1
        assert len(replica.index) == min(i + 1, 5)  # the 5 most recently learned spans, 8 tokens each
    assert replica.index.find(list(range(139, 147)), "k0/s00000039", 4)  # the newest is matched


def test_spans_a_fetch_evicts_leave_the_index(tmp_path):
    url = f"disk:{tmp_path / 'tier'}"
    match = MatchConfig(min_match_tokens=4)
    peer = SpanCatalog(open_store(url, 1 << 24, fingerprint="fp"), "fp", block_len=4, match=match)
    one_span_bytes = _span(tuple(range(8))).nbytes
    replica = SpanCatalog(open_store(url, one_span_bytes, fingerprint="fp"), "fp", block_len=4, match=match)
    span_ids = [peer.new_span_id() for _ in range(3)]
    for k, span_id in enumerate(span_ids):
        peer.put("team", span_id, _span(tuple(range(10 * k, 10 * k + 8))))
    assert replica.learn_published("team") == 3
    for span_id in span_ids:
        replica.store.pin(span_id, "team")  # fetched into memory, evicting the one before
        replica.store.unpin(span_id, "team")
    replica.learn_published("team")
    assert span_ids[0] not in replica.index and span_ids[1] not in replica.index and span_ids[2] in replica.index
