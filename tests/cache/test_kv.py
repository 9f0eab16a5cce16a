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
