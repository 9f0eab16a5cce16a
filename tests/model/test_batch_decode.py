"""Batched decode of branches over one shared prefix equals decoding them one by one."""

import pytest
import torch

from kvrelay.cache.kv import SequenceKV
from kvrelay.cache.shared import SharedPrefixKV, kv_bytes
from kvrelay.engine import generate
from kvrelay.engine.batch import generate_batch
from kvrelay.errors import ScheduleError
from kvrelay.model.batch_decode import decode_step_batch
from kvrelay.model.sampling import SamplingConfig
from kvrelay.model.schedule import SuffixSchedule
from kvrelay.reuse.rksc import RKSCMethod, SharedRoot
from tests.helpers import tiny_lm


@pytest.fixture(scope="module", params=["llama3", "mistral"])  # mistral: sliding window 16 over both segments
def lm64(request):
    lm = tiny_lm(request.param)
    lm.model.double()
    return lm


def _ids(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _root(lm, root_ids):
    cache = SequenceKV(lm.config, lm.model.dtype, "cpu", capacity=len(root_ids))
    lm.model.prefill(torch.tensor(root_ids), cache)
    return cache


def test_batched_step_equals_one_step_per_row(lm64):
    model = lm64.model
    root_ids = _ids(13, 0)
    root = _root(lm64, root_ids)
    suffixes = [_ids(2 + 5 * b, b + 1) for b in range(3)]  # rows end at positions 15, 20, 25
    singles = [SharedPrefixKV(root, 13, capacity=40) for _ in suffixes]
    batch = SharedPrefixKV.batch(root, 13, 40, len(suffixes))
    for s, single, row in zip(suffixes, singles, batch, strict=True):
        model.prefill(torch.tensor(root_ids + s), single, SuffixSchedule(13))
        model.prefill(torch.tensor(root_ids + s), row, SuffixSchedule(13))
    tokens = [[7, 8, 9], [1, 2, 3], [4, 5, 6], [10, 11, 12]]
    for step, ids in enumerate(tokens[:3]):
        expected = torch.stack([model.decode_step(t, c) for t, c in zip(ids, singles, strict=True)])
        got = decode_step_batch(model, ids, batch)
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=0)
        assert [c.length for c in batch] == [c.length for c in singles], step
    # a subset of rows (the others finished): rows 0 and 2 only
    expected = torch.stack([model.decode_step(t, singles[b]) for t, b in ((10, 0), (12, 2))])
    got = decode_step_batch(model, [10, 12], [batch[0], batch[2]])
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=0)
    assert batch[1].length == singles[1].length
    for single, row in zip(singles, batch, strict=True):  # the K/V each row wrote is the one-by-one K/V
        n = single.length - 13
        torch.testing.assert_close(row.k[:, :, :n], single.k[:, :, :n], atol=1e-10, rtol=0)
        torch.testing.assert_close(row.v[:, :, :n], single.v[:, :, :n], atol=1e-10, rtol=0)


def test_batch_memory_counts_one_common_storage_and_cannot_grow(lm64):
    root = _root(lm64, _ids(8, 0))
    batch = SharedPrefixKV.batch(root, 8, 5, 4)
    cfg = lm64.config
    row_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 8  # K and V, fp64
    assert kv_bytes(batch) == (8 + 4 * 5) * row_bytes  # the root once + 4 rows x 5 own slots
    # padding slots are read with probability 0: they must hold zeros, never uninitialised NaN
    assert not batch[0].batch_k.any() and not batch[0].batch_v.any()
    with pytest.raises(ScheduleError, match="capacity"):
        batch[0].ensure_capacity(8 + 6)
    with pytest.raises(ScheduleError, match="made together"):
        decode_step_batch(lm64.model, [1, 2], [batch[0], SharedPrefixKV(root, 8)])


def test_generate_batch_equals_generate_per_branch(lm64):
    root_ids = _ids(17, 0)
    prompts = [root_ids + _ids(3 + 4 * b, 10 + b) for b in range(4)]
    method = RKSCMethod(exit_theta=0.0, probe_attention=False)
    method.root = SharedRoot(tuple(root_ids), _root(lm64, root_ids))
    sampling = SamplingConfig(max_new_tokens=9)
    one_by_one = [generate(lm64, ids, method, None, sampling, keep_cache=True) for ids in prompts]
    seen = []
    batched = generate_batch(lm64, prompts, method, sampling, keep_cache=True,
                             on_prefill=lambda i, plan: seen.append((i, plan.shared_len)))
    assert seen == [(b, 17) for b in range(4)]
    for a, b in zip(one_by_one, batched, strict=True):
        assert b.output_ids == a.output_ids and b.stop_reason == a.stop_reason
        assert b.top1_probs == pytest.approx(a.top1_probs, abs=1e-10)
        assert b.stats.num_computed_token_layers == a.stats.num_computed_token_layers
        assert b.cache.length == a.cache.length  # the last output token's K/V is there (keep_cache)
        n = a.cache.length - 17
        torch.testing.assert_close(b.cache.k[:, :, :n], a.cache.k[:, :, :n], atol=1e-10, rtol=0)


def test_generate_batch_refuses_calls_without_the_shared_prefix(lm64):
    root_ids = _ids(17, 0)
    method = RKSCMethod()
    method.root = SharedRoot(tuple(root_ids), _root(lm64, root_ids))
    with pytest.raises(ScheduleError, match="call 1"):
        generate_batch(lm64, [root_ids + [1, 2], _ids(20, 5)], method, SamplingConfig(max_new_tokens=2))
