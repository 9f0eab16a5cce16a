"""RSBCM and LRU block eviction on hand-made traces: exact order, pins, budget, replay."""

import sys

import pytest

from kvrelay.cache.blocks import BlockCache, replay
from kvrelay.errors import ConfigError


def test_block_bookkeeping_does_not_import_torch():
    import kvrelay.cache.blocks as blocks_mod

    assert "torch" not in blocks_mod.__dict__
    assert "kvrelay.cache.blocks" in sys.modules


def _payload(i):
    return (f"kv{i}", 10)


def _cache(policy, budget=50):
    return BlockCache(budget, policy, block_len=2, fingerprint="fp")


def test_rsbcm_evicts_by_importance_over_depth_exactly():
    c = _cache("rsbcm")
    seq = [1, 2, 3, 4, 5, 6, 7, 8]  # 4 blocks at depths 0..3
    assert c.insert(seq, _payload) == 4
    keys = c.keys(seq)
    c.add_importance(keys, [4.0, 3.0, 3.0, 0.5])  # scores 4/1, 3/2, 3/3, 0.5/4
    assert c.eviction_order() == [keys[3], keys[2], keys[1], keys[0]]
    other = [1, 2, 9, 9]  # shares block 0, adds one block at depth 1 with importance 0
    c.insert(other, _payload)
    assert len(c.blocks) == 5 and c.used_bytes == 50
    third = [7, 7]  # one more block at depth 0: the budget forces exactly one eviction
    c.insert(third, _payload)
    okey = c.keys(other)[1]
    assert okey not in c.blocks  # importance 0 -> score 0, the smallest
    c.add_importance(c.keys(third), [10.0])
    c.insert([6, 6], _payload)
    assert keys[3] not in c.blocks  # then 0.5 / 4 (the new [7, 7] block scores 10 / 1)
    assert c.stats.num_evicted_blocks == 2


def test_rsbcm_ties_go_least_recent_then_deepest():
    c = _cache("rsbcm", budget=100)
    a, b = [1, 1, 2, 2], [3, 3]
    c.insert(a, _payload)  # two blocks, one access: same tick
    c.insert(b, _payload)
    ka, kb = c.keys(a), c.keys(b)
    assert c.eviction_order() == [ka[1], ka[0], kb[0]]  # all importance 0: oldest tick first, deeper first


def test_lru_evicts_least_recent_and_lookup_touches_the_chain():
    c = _cache("lru", budget=30)
    a, b, d = [1, 1], [2, 2], [3, 3]
    for s in (a, b, d):
        c.insert(s, _payload)
    c.lookup(a)  # a becomes the most recent
    c.insert([4, 4], _payload)
    assert c.keys(b)[0] not in c.blocks and c.keys(a)[0] in c.blocks
    assert [len(c.lookup(s)) for s in (a, b)] == [1, 0]
    assert c.stats.num_recomputed_tokens == 2  # b was held before: its miss costs a recompute


def test_pinned_blocks_are_never_evicted_and_a_full_cache_rejects():
    c = _cache("rsbcm", budget=20)
    c.insert([1, 1, 2, 2], _payload)
    keys = c.keys([1, 1, 2, 2])
    c.pin(keys)
    assert c.insert([5, 5], _payload) == 0
    assert c.stats.num_rejected_blocks == 1 and set(c.blocks) == set(keys)
    c.unpin(keys)
    assert c.insert([5, 5], _payload) == 1
    assert keys[1] not in c.blocks  # the deeper, unimportant one went


def test_lookup_stops_at_the_first_missing_block_and_counts_hits():
    c = _cache("lru", budget=100)
    c.insert([1, 1, 2, 2, 3, 3], _payload)
    assert len(c.lookup([1, 1, 2, 2, 9, 9, 3, 3])) == 2
    assert (c.stats.num_lookup_blocks, c.stats.num_hit_blocks) == (4, 2)
    assert c.stats.num_recomputed_tokens == 0  # never held: first computation, not a recompute


def test_replay_reproduces_the_live_statistics():
    live = _cache("rsbcm", budget=40)
    for i in range(6):
        seq = [0, 0, i, i, i + 1, i + 1]
        live.lookup(seq)
        live.insert(seq, _payload)
        live.add_importance(live.keys(seq), [1.0, 0.5, 0.1])
    assert replay(live.events, 40, "rsbcm", block_len=2).to_dict() == live.stats.to_dict()
    lru = replay(live.events, 40, "lru", block_len=2)
    assert lru.num_lookup_blocks == live.stats.num_lookup_blocks


def test_bad_configuration_is_refused():
    with pytest.raises(ConfigError, match="policy"):
        BlockCache(10, "fifo")
    with pytest.raises(ConfigError, match="positive"):
        BlockCache(0, "lru")
