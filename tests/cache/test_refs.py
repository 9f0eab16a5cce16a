"""Loaded spans read in place: attention, copy on write, and every other reader sees what a copy would give."""

import pytest
import torch

from kvrelay.cache import kv
from kvrelay.cache.kv import SequenceKV, StoredSpan
from kvrelay.model.config import ModelConfig
from kvrelay.model.layers import visible_mask
from kvrelay.model.rope import RotaryEmbedding
from kvrelay.model.schedule import StaticSchedule
from tests.helpers import tiny_lm

CFG = ModelConfig(family="llama", vocab_size=10, hidden_size=16, intermediate_size=8, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)
N = 24


@pytest.fixture(autouse=True)
def every_span_in_place(monkeypatch, request):
    """The toy spans are short: read them in place all the same (but in the test of that rule)."""
    if "only_long" not in request.node.name:
        monkeypatch.setattr(kv, "IN_PLACE_MIN_TOKENS", 1)


def _span(seed: int, n: int, start_pos: int) -> StoredSpan:
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(3, 2, n, 8, generator=g), torch.randn(3, 2, n, 8, generator=g)
    return StoredSpan(tuple(range(n)), start_pos, k, v, "fp")


def _caches():
    """The same loads twice: ``lazy`` reads the spans in place, ``copied`` has every row copied in."""
    rope = RotaryEmbedding(CFG)
    exact, moved = _span(1, 8, 0), _span(2, 9, 3)  # the second is loaded 7 positions later than stored
    caches = []
    for rule in (1, 10**9):  # the second copies when loaded (the path every short span takes)
        kv.IN_PLACE_MIN_TOKENS = rule
        cache = SequenceKV(CFG, torch.float32, "cpu", capacity=N)
        assert cache.load_span(exact, 0, rope) == 0
        assert cache.load_span(moved, 11, rope, src_start=1) == 8  # positions 11..18
        caches.append(cache)
    kv.IN_PLACE_MIN_TOKENS = 1
    lazy, copied = caches
    assert lazy._refs and all(r.layers == {0, 1, 2} for r in lazy._refs)
    assert not copied._refs
    return lazy, copied


def _write_own(cache: SequenceKV, slots: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in range(3):
        cache.write(layer, slots, torch.randn(2, slots.numel(), 8, generator=g),
                    torch.randn(2, slots.numel(), 8, generator=g))


def test_attention_over_spans_in_place_equals_attention_over_copies():
    lazy, copied = _caches()
    own = torch.tensor([8, 9, 10, 19, 20, 21, 22, 23])  # between and after the spans
    for cache in (lazy, copied):
        _write_own(cache, own, seed=3)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(4, own.numel(), 8, generator=g)
    for window in (None, 6):  # with a window some queries see nothing of a span
        mask = visible_mask(own, N, window)
        for layer in range(3):
            got = lazy.attend(layer, q, mask, False, N)
            torch.testing.assert_close(got, copied.attend(layer, q, mask, False, N), atol=1e-5, rtol=0)
    assert all(r.layers == {0, 1, 2} for r in lazy._refs)  # attention copied nothing


def test_a_write_over_a_span_copies_that_layer_only_and_wins():
    lazy, copied = _caches()
    for cache in (lazy, copied):
        _write_own(cache, torch.tensor([8, 9, 10, 19, 20, 21, 22, 23]), seed=3)
    slots = torch.tensor([2, 12])  # one row in each span, written at layer 1
    k_new, v_new = torch.full((2, 2, 8), 0.7), torch.full((2, 2, 8), -0.7)
    for cache in (lazy, copied):
        cache.write(1, slots, k_new, v_new)
    assert [r.layers for r in lazy._refs] == [{0, 2}, {0, 2}]
    mask = visible_mask(torch.tensor([23]), N, None)
    q = torch.randn(4, 1, 8, generator=torch.Generator().manual_seed(5))
    for layer in (0, 1):
        torch.testing.assert_close(lazy.attend(layer, q, mask, False, N), copied.attend(layer, q, mask, False, N),
                                   atol=1e-5, rtol=0)
    torch.testing.assert_close(lazy.kv(1, 0, N)[0][:, 12], k_new[:, 1])


def test_an_add_over_a_span_copies_that_layer_only_and_adds_to_the_loaded_rows():
    lazy, copied = _caches()
    for cache in (lazy, copied):  # the rows no span covers, the same in both
        _write_own(cache, torch.tensor([8, 9, 10, 19, 20, 21, 22, 23]), seed=3)
    slots = torch.tensor([2, 3, 12])  # rows of both spans, moved at layer 2
    k_add, v_add = torch.full((2, 1, 8), 0.25), torch.full((2, 1, 8), -0.5)  # one move for every row
    before = copied.gather(2, slots)
    for cache in (lazy, copied):
        cache.add(2, slots, k_add, v_add)
    assert [r.layers for r in lazy._refs] == [{0, 1}, {0, 1}]
    torch.testing.assert_close(lazy.gather(2, slots)[0], before[0] + 0.25, atol=1e-6, rtol=0)
    torch.testing.assert_close(lazy.gather(2, slots)[1], before[1] - 0.5, atol=1e-6, rtol=0)
    torch.testing.assert_close(lazy.kv(2, 0, N), copied.kv(2, 0, N), atol=1e-6, rtol=0)


def test_every_other_reader_sees_the_loaded_rows():
    lazy, copied = _caches()
    torch.testing.assert_close(lazy.kv(2, 0, 19)[0], copied.kv(2, 0, 19)[0], atol=1e-6, rtol=0)  # moved keys
    assert lazy._refs[1].layers == {0, 1}
    rows = torch.tensor([0, 5, 14])
    torch.testing.assert_close(lazy.gather(0, rows), copied.gather(0, rows), atol=1e-6, rtol=0)
    lazy.length = 19
    span = lazy.export(0, 19, list(range(19)), "fp")  # every layer
    for rows in (slice(0, 8), slice(11, 19)):
        torch.testing.assert_close(span.k[:, :, rows], copied.k[:, :, rows], atol=1e-6, rtol=0)
        torch.testing.assert_close(span.v[:, :, rows], copied.v[:, :, rows], atol=0, rtol=0)
    assert all(not r.layers for r in lazy._refs)


def test_a_load_over_written_rows_wins_as_a_copy_would():
    rope = RotaryEmbedding(CFG)
    span = _span(6, 5, 2)
    cache = SequenceKV(CFG, torch.float32, "cpu", capacity=N)
    cache.write(0, torch.tensor([3, 4]), torch.ones(2, 2, 8), torch.ones(2, 2, 8))
    cache.load_span(span, 2, rope)
    torch.testing.assert_close(cache.kv(0, 2, 7)[1], span.v[0])
    later = _span(7, 5, 2)  # a second load over the first one's positions
    cache.load_span(later, 2, rope)
    kv.IN_PLACE_MIN_TOKENS = 10**9
    copied = SequenceKV(CFG, torch.float32, "cpu", capacity=N)
    copied.load_span(later, 2, rope)
    kv.IN_PLACE_MIN_TOKENS = 1
    for c in (cache, copied):
        c.write(2, torch.tensor([0, 1, 7]), torch.ones(2, 3, 8), torch.ones(2, 3, 8))
    q, mask = torch.randn(4, 1, 8, generator=torch.Generator().manual_seed(9)), visible_mask(torch.tensor([7]), 8, None)
    torch.testing.assert_close(cache.attend(2, q, mask, False, 8), copied.attend(2, q, mask, False, 8), atol=1e-5,
                               rtol=0)
    torch.testing.assert_close(cache.kv(1, 2, 7)[1], later.v[1])


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])  # gemma3: sliding windows, a RoPE base per layer kind
def test_a_forward_with_spans_in_place_matches_one_with_copies(family):
    lm = tiny_lm(family)
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(8))
    full = SequenceKV(lm.config, torch.float32, "cpu")
    lm.model.prefill(ids, full, StaticSchedule(torch.arange(40)))
    full.length = 40
    exact, moved = full.export(0, 15, ids[:15].tolist(), "fp"), full.export(18, 30, ids[18:30].tolist(), "fp")
    new_idx = torch.cat([torch.arange(15, 20), torch.arange(32, 40)])
    logits = []
    for copy in (False, True):
        kv.IN_PLACE_MIN_TOKENS = 10**9 if copy else 1
        cache = SequenceKV(lm.config, torch.float32, "cpu")
        cache.load_span(exact, 0, lm.model.rope)
        cache.load_span(moved, 20, lm.model.rope)  # 12 tokens two positions later than computed
        logits.append(lm.model.prefill(ids, cache, StaticSchedule(new_idx)).logits)
        if not copy:
            assert len(cache._refs) == 2
            assert all(r.layers == set(range(lm.config.num_layers)) for r in cache._refs)
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=0)


def test_only_long_spans_are_read_in_place():
    rope = RotaryEmbedding(CFG)
    short = SequenceKV(CFG, torch.float32, "cpu", capacity=N)
    short.load_span(_span(9, 8, 3), 11, rope)  # 8 tokens, moved: far below the rule's length
    assert not short._refs and short._k[:, :, 11:19].abs().sum() > 0  # copied when loaded
    cache = SequenceKV(CFG, torch.float32, "cpu", capacity=2 * kv.IN_PLACE_MIN_TOKENS)
    cache.load_span(_span(10, kv.IN_PLACE_MIN_TOKENS, 0), 0, rope)
    cache.load_span(_span(11, kv.IN_PLACE_MIN_TOKENS, 0), kv.IN_PLACE_MIN_TOKENS + 1, rope)  # moved
    cache.load_span(_span(12, kv.IN_PLACE_MIN_TOKENS - 1, 0), 0, rope)  # one token short: copied
    assert [r.num_tokens for r in cache._refs] == [kv.IN_PLACE_MIN_TOKENS] * 2
    assert [r.delta for r in cache._refs] == [0, kv.IN_PLACE_MIN_TOKENS + 1]
    assert cache._refs[0].layers == set()  # the short load over its positions copied it in first


def test_no_mask_means_what_sdpa_means_with_spans_in_place():
    lazy, copied = _caches()
    for cache in (lazy, copied):
        _write_own(cache, torch.tensor([8, 9, 10, 19, 20, 21, 22, 23]), seed=3)
    q = torch.randn(4, N, 8, generator=torch.Generator().manual_seed(12))
    for causal, num_q in ((True, N), (False, 5)):  # causal: query i sees keys 0..i; else every key
        got = lazy.attend(1, q[:, :num_q], None, causal, N)
        torch.testing.assert_close(got, copied.attend(1, q[:, :num_q], None, causal, N), atol=1e-5, rtol=0)
    assert all(r.layers == {0, 1, 2} for r in lazy._refs)
