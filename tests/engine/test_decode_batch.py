"""A batched decode step over sequences of any cache kind and length equals one step per sequence."""

import pytest
import torch

from kvrelay.branches.rksc import RKSCMethod, SharedRoot
from kvrelay.branches.shared_kv import SharedPrefixKV
from kvrelay.cache.kv import SequenceKV
from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine, GenerateOptions
from kvrelay.errors import ScheduleError
from kvrelay.model.sampling import SamplingConfig
from kvrelay.model.schedule import SuffixSchedule
from tests.helpers import tiny_lm


@pytest.fixture(scope="module", params=["llama3", "mistral"])  # mistral: a sliding window of 16
def lm64(request):
    lm = tiny_lm(request.param)
    lm.model.double()
    return lm


def _ids(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefilled(lm, ids):
    cache = SequenceKV(lm.config, lm.model.dtype, "cpu", capacity=len(ids))
    lm.model.prefill(torch.tensor(ids), cache)
    return cache


def _pair(lm, kind, ids, root=None):
    """Two caches holding the same prompt ids (one for the batch, one for single steps)."""
    if kind == "plain":
        return _prefilled(lm, ids), _prefilled(lm, ids)
    caches = []
    for _ in range(2):
        cache = SharedPrefixKV(root, 13, capacity=40)
        lm.model.prefill(torch.tensor(ids), cache, SuffixSchedule(13))
        caches.append(cache)
    return caches


def test_batched_step_equals_one_step_per_row(lm64):
    model = lm64.model
    root_ids = _ids(13, 0)
    root = _prefilled(lm64, root_ids)
    # rows of different lengths (5..27: some past the window of 16) and cache kinds
    prompts = [("plain", _ids(5, 1)), ("shared", root_ids + _ids(7, 2)), ("plain", _ids(27, 3)),
               ("shared", root_ids + _ids(2, 4))]
    pairs = [_pair(lm64, kind, ids, root) for kind, ids in prompts]
    batch, singles = [b for b, _ in pairs], [s for _, s in pairs]
    tokens = [[7, 8, 9, 10], [1, 2, 3, 4], [4, 5, 6, 7]]
    for step, ids in enumerate(tokens):
        expected = torch.stack([model.decode_step(t, c) for t, c in zip(ids, singles, strict=True)])
        got = model.decode(ids, batch)
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=0)
        assert [c.length for c in batch] == [c.length for c in singles], step
    got = model.decode([10, 12], [batch[0], batch[3]])  # a subset of rows (the others finished)
    expected = torch.stack([model.decode_step(10, singles[0]), model.decode_step(12, singles[3])])
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=0)
    for row, single in zip(batch, singles, strict=True):  # the K/V each row wrote is the one-by-one K/V
        k_row, v_row = row.kv_all(0, row.length)
        k_one, v_one = single.kv_all(0, single.length)
        torch.testing.assert_close(k_row, k_one, atol=1e-10, rtol=0)
        torch.testing.assert_close(v_row, v_one, atol=1e-10, rtol=0)


def test_a_decode_step_needs_one_token_per_cache(lm64):
    cache = _prefilled(lm64, _ids(4, 0))
    with pytest.raises(ScheduleError, match="one token per cache"):
        lm64.model.decode([1, 2], [cache])


def test_generate_batch_equals_generate_per_call(lm64):
    """Engine.generate_batch (one batched decode) gives generate's outputs, stats and K/V per call."""
    root_ids = _ids(17, 0)
    prompts = [root_ids + _ids(3 + 4 * b, 10 + b) for b in range(4)]
    method = RKSCMethod()
    method.probe_attention = False
    method.root = SharedRoot(tuple(root_ids), _prefilled(lm64, root_ids))
    options = GenerateOptions(SamplingConfig(max_new_tokens=9), keep_cache=True)
    engine = Engine(lm64)
    one_by_one = [engine.generate(ids, method, options) for ids in prompts]
    batched = engine.generate_batch(prompts, method, options)
    for a, b in zip(one_by_one, batched, strict=True):
        assert b.output_ids == a.output_ids and b.stop_reason == a.stop_reason
        assert b.top1_probs == pytest.approx(a.top1_probs, abs=1e-10)
        assert b.stats.num_computed_token_layers == a.stats.num_computed_token_layers
        assert b.stats.num_reused_tokens == a.stats.num_reused_tokens == 17  # the root, by reference
        assert b.cache.length == a.cache.length  # the last output token's K/V is there (keep_cache)
        torch.testing.assert_close(b.cache.kv_all(0, b.cache.length)[0], a.cache.kv_all(0, a.cache.length)[0],
                                   atol=1e-10, rtol=0)


def test_generate_batch_mixes_calls_with_and_without_reuse(lm64):
    """Continuous batching: calls with a stored prefix and calls without decode in one batch."""
    engine = Engine(lm64, KVStore(1 << 26), methods=("prefix",))
    up = _ids(20, 7)
    engine.publish("up", engine.generate(up, "full", GenerateOptions(SamplingConfig(max_new_tokens=3),
                                                                      keep_cache=True)))
    prompts = [up + _ids(4, 8), _ids(9, 9), up[:18] + _ids(6, 10)]  # 16-token blocks, then token by token
    options = GenerateOptions(SamplingConfig(max_new_tokens=6))
    single = [engine.generate(ids, "prefix", options) for ids in prompts]
    batched = engine.generate_batch(prompts, "prefix", options)
    assert [o.stats.num_reused_tokens for o in batched] == [20, 0, 18]
    for a, b in zip(single, batched, strict=True):
        assert b.output_ids == a.output_ids
        torch.testing.assert_close(b.first_logits, a.first_logits, atol=1e-10, rtol=0)
