"""Per-sequence cache and stored spans."""

import pytest
import torch

from kvrelay.cache.kv import SequenceKV, StoredSpan
from kvrelay.model.config import ModelConfig
from kvrelay.model.rope import RotaryEmbedding

CFG = ModelConfig(family="llama", vocab_size=10, hidden_size=16, intermediate_size=8, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=4, max_position_embeddings=64)


def test_span_nbytes_is_exact():
    k = torch.zeros(3, 2, 5, 4)
    span = StoredSpan(tuple(range(5)), 0, k, k.clone(), "fp", {1: torch.zeros(5, 16, dtype=torch.bfloat16)})
    assert span.nbytes == 2 * (3 * 2 * 5 * 4 * 4) + 5 * 16 * 2


def test_span_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="do not match 4 tokens"):
        StoredSpan((1, 2, 3, 4), 0, torch.zeros(3, 2, 5, 4), torch.zeros(3, 2, 5, 4), "fp")


def test_capacity_doubles_and_keeps_contents():
    cache = SequenceKV(CFG, torch.float32, "cpu", capacity=2)
    for pos in range(9):
        cache.ensure_capacity(pos + 1)
        cache.write_range(1, pos, torch.full((2, 1, 4), float(pos)), torch.full((2, 1, 4), -float(pos)))
        cache.length = pos + 1
    assert cache.capacity == 16  # 2 -> 4 -> 8 -> 16: O(n) copying in total
    assert cache.k[1, 0, :9, 0].tolist() == [float(p) for p in range(9)]
    assert cache.filled[1, :9].all() and not cache.filled[0].any()


def test_export_then_load_round_trip_at_same_position():
    rope = RotaryEmbedding(CFG)
    a = SequenceKV(CFG, torch.float32, "cpu")
    a.k[:, :, :6].normal_()
    a.v[:, :, :6].normal_()
    a.filled[:, :6] = True
    a.length = 6
    span = a.export(2, 6, [5, 6, 7, 8], "fp")
    b = SequenceKV(CFG, torch.float32, "cpu")
    assert b.load_span(span, 3, rope, src_start=1) == 0  # tokens 1..3 of the span at their own positions
    torch.testing.assert_close(b.k[:, :, 3:6], a.k[:, :, 3:6], atol=0, rtol=0)
    assert b.filled[:, 3:6].all() and not b.filled[:, :3].any()
    a.k.zero_()
    assert span.k.abs().sum() > 0  # the export is a copy
    with pytest.raises(ValueError, match="past the sequence length"):
        a.export(0, 7, list(range(7)), "fp")


def _span_at_zero(n: int, seed: int = 0) -> StoredSpan:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(CFG.num_layers, CFG.num_kv_heads, n, CFG.head_dim, generator=g)
    return StoredSpan(tuple(range(n)), 0, k, torch.randn(k.shape, generator=g), "fp")


def test_an_unmoved_prefix_is_read_in_place_not_copied():
    span, rope = _span_at_zero(6), RotaryEmbedding(CFG)
    cache = SequenceKV(CFG, torch.float32, "cpu", capacity=10)
    assert cache.load_span(span, 0, rope, 0, 5) == 0
    runs = cache.kv_runs(1, 0, 8)  # the prefix's rows, then the cache's own
    assert [k.shape[1] for k, _ in runs] == [5, 3]
    assert runs[0][0].data_ptr() == span.k[1].data_ptr()  # a view of the stored span
    assert bool(cache.filled[:, :5].all()) and not bool(cache.filled[:, 5:].any())


def test_a_write_or_one_run_read_inside_the_shared_prefix_copies_it_first():
    span, rope = _span_at_zero(6), RotaryEmbedding(CFG)
    before = span.k.clone()
    cache = SequenceKV(CFG, torch.float32, "cpu", capacity=10)
    cache.load_span(span, 0, rope)
    k_all, _ = cache.kv(2, 0, 6)  # a method reading the layer as one run: the prefix is copied in
    torch.testing.assert_close(k_all, span.k[2])
    assert cache.shared is None and k_all.data_ptr() == cache.k[2].data_ptr()
    cache.write_range(0, 1, torch.zeros(CFG.num_kv_heads, 1, CFG.head_dim), torch.zeros(CFG.num_kv_heads, 1, 4))
    assert torch.equal(span.k, before)  # the stored span is never written


def test_a_moved_span_or_a_nonempty_cache_is_copied():
    span, rope = _span_at_zero(6), RotaryEmbedding(CFG)
    moved = SequenceKV(CFG, torch.float32, "cpu", capacity=10)
    moved.load_span(span, 2, rope)
    assert moved.shared is None and len(moved.kv_runs(0, 0, 8)) == 1
    busy = SequenceKV(CFG, torch.float32, "cpu", capacity=20)
    busy.load_span(_span_at_zero(3, seed=1), 10, rope, 0, 3)
    busy.load_span(span, 0, rope)
    assert busy.shared is None
    torch.testing.assert_close(busy.kv(0, 0, 6)[1], span.v[0])
