"""RSBCM and LRU block eviction on hand-made traces: exact order, pins, budget, replay."""

import pytest

from kvrelay.branches.blocks import BlockCache, interleave, replay
from kvrelay.errors import ConfigError


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


def test_interleave_round_robin_order_and_refill():
    a, b, c = [("a", i) for i in range(3)], [("b", i) for i in range(1)], [("c", i) for i in range(2)]
    assert interleave([a, b, c], 1) == a + b + c
    # a and b in flight; b ends after one event and c takes its place
    assert interleave([a, b, c], 2) == [("a", 0), ("b", 0), ("a", 1), ("c", 0), ("a", 2), ("c", 1)]
    assert interleave([a, [], c], 5) == [("a", 0), ("c", 0), ("a", 1), ("c", 1), ("a", 2)]
    with pytest.raises(ConfigError, match="concurrency"):
        interleave([a], 0)


def test_interleaved_requests_separate_rsbcm_from_lru():
    ten = (10,)
    req_a = [("insert", ("a0",), ten), ("importance", ("a0",), (5.0,)), ("lookup", ("a0",)), ("lookup", ("a0",))]
    req_b = [("insert", ("b0",), ten), ("insert", ("d0",), ten), ("lookup", ("b0",))]
    # two in flight, room for two blocks: inserting d0 evicts the important-but-older a0 under LRU and
    # the unimportant-but-recent b0 under RSBCM
    trace = interleave([req_a, req_b], 2)
    rsbcm, lru = replay(trace, 20, "rsbcm", block_len=2), replay(trace, 20, "lru", block_len=2)
    assert (rsbcm.num_lookup_blocks, rsbcm.num_hit_blocks, rsbcm.num_recomputed_tokens) == (3, 2, 2)
    assert (lru.num_lookup_blocks, lru.num_hit_blocks, lru.num_recomputed_tokens) == (3, 1, 4)
    # one after another: a is done before b arrives; then b0 goes under RSBCM, a0 under LRU
    seq_rsbcm, seq_lru = (replay(interleave([req_a, req_b], 1), 20, p, block_len=2) for p in ("rsbcm", "lru"))
    assert (seq_rsbcm.num_hit_blocks, seq_lru.num_hit_blocks) == (2, 3)


def _fill_then_insert_c0(cache):
    """a0 credited 8 early, b0 credited 1 late, then c0 needs one of their places (room for two)."""
    size = lambda i: (None, 10)  # noqa: E731
    cache.insert_keys(["a0"], size)
    cache.add_importance(["a0"], [8.0])
    cache.insert_keys(["b0"], size)
    for _ in range(4):
        cache.lookup_keys(["x"])
    cache.add_importance(["b0"], [1.0])
    cache.insert_keys(["c0"], size)  # the 7th operation
    return set(cache.blocks)


def test_importance_half_life_lets_stale_credit_fade():
    # no decay (RKSC): a0's old credit of 8 outranks b0's fresh 1, so b0 goes
    assert _fill_then_insert_c0(BlockCache(20, "rsbcm", 2)) == {"a0", "c0"}
    # half-life of one operation: at c0's insert a0 holds 8 / 2**6, b0 1 / 2, so a0 goes
    assert _fill_then_insert_c0(BlockCache(20, "rsbcm", 2, half_life_ops=1)) == {"b0", "c0"}
    with pytest.raises(ConfigError, match="half_life_ops"):
        BlockCache(20, "rsbcm", 2, half_life_ops=-1)


def test_lookup_and_insert_pin_in_the_same_step_and_unpin_releases_exactly():
    c = _cache("rsbcm", budget=30)  # room for three blocks
    seq = [1, 1, 2, 2]
    assert c.lookup(seq, pin=True) == []
    added = c.insert_keys(c.keys(seq), _payload, pin=True)
    assert added == c.keys(seq) and [c.blocks[k].pins for k in added] == [1, 1]
    assert c.insert([5, 5, 6, 6], _payload) == 1 and c.stats.num_rejected_blocks == 1  # only one place is free
    hits = c.lookup(seq, pin=True)  # a second request on the same prefix
    assert [b.pins for b in hits] == [2, 2]
    assert c.insert_keys(c.keys(seq), _payload, pin=True) == []  # present: touched, not pinned again
    c.unpin(added)
    assert [c.blocks[k].pins for k in added] == [1, 1]
    assert replay(c.events, 30, "rsbcm", block_len=2).to_dict() == c.stats.to_dict()


def test_pins_taken_at_lookup_and_insert_keep_a_fresh_root_through_other_requests():
    ten = (10,)
    req_a = [("lookup", ("a0", "a1"), True), ("insert", ("a0", "a1"), (10, 10), True),
             ("lookup", ("z0",), False),  # the request computing (another access) before it reads its root
             ("lookup", ("a0", "a1"), False), ("unpin", ("a0", "a1"))]
    req_b = [("insert", ("b0",), ten, False), ("importance", ("b0",), (5.0,)), ("insert", ("c0",), ten, False)]
    trace = interleave([req_a, req_b], 2)  # c0's insert falls between a's insert and a's read
    for policy in ("rsbcm", "lru"):
        stats = replay(trace, 30, policy, block_len=2)
        assert (stats.num_hit_blocks, stats.num_recomputed_tokens) == (2, 0)
    # the same trace with the pin flags dropped (lookup, insert and pin as separate steps, session 3's
    # first interleaved measurement): RSBCM evicts the fresh uncredited root, LRU the older b0
    unpinned = [e[:2] if e[0] == "lookup" else e[:3] if e[0] == "insert" else e for e in trace]
    rsbcm, lru = (replay(unpinned, 30, p, block_len=2) for p in ("rsbcm", "lru"))
    assert (rsbcm.num_hit_blocks, rsbcm.num_recomputed_tokens) == (1, 2)
    assert (lru.num_hit_blocks, lru.num_recomputed_tokens) == (2, 0)
