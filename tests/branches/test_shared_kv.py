"""A shared-prefix cache: branches read the root by reference and give full's logits exactly."""

import pytest
import torch

from kvrelay.branches.shared_kv import SharedPrefixKV, kv_bytes
from kvrelay.cache.kv import SequenceKV
from kvrelay.errors import ScheduleError
from kvrelay.model.schedule import SuffixSchedule
from tests.helpers import tiny_lm


@pytest.fixture(scope="module", params=["llama3", "mistral"])  # mistral: sliding window over two segments
def lm64(request):
    lm = tiny_lm(request.param)
    lm.model.double()
    return lm


def _ids(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def _decode(model, first_logits, cache, steps):
    logits, out = first_logits, []
    for _ in range(steps):
        out.append(int(logits.argmax()))
        logits = model.decode_step(out[-1], cache)
    return out, logits


def test_shared_prefix_branches_give_full_logits(lm64):
    model, cfg = lm64.model, lm64.config
    root = _ids(21, 0)
    root_cache = SequenceKV(cfg, model.dtype, "cpu", capacity=21)
    model.prefill(root, root_cache)
    before = root_cache.k.clone()
    for b in range(3):
        prompt = torch.cat([root, _ids(5 + 3 * b, b + 1)])
        full_cache = SequenceKV(cfg, model.dtype, "cpu", capacity=64)
        full = model.prefill(prompt, full_cache)
        branch = SharedPrefixKV(root_cache, 21, capacity=40)
        shared = model.prefill(prompt, branch, SuffixSchedule(21))
        torch.testing.assert_close(shared.logits, full.logits, atol=1e-10, rtol=0)
        full_ids, full_last = _decode(model, full.logits, full_cache, 12)
        branch_ids, branch_last = _decode(model, shared.logits, branch, 12)
        assert branch_ids == full_ids
        torch.testing.assert_close(branch_last, full_last, atol=1e-10, rtol=0)
        # the branch holds no copy of the root: its own rows start at the root's end
        assert branch.prefix.k.data_ptr() == root_cache.k.data_ptr()
        assert branch.k.shape[2] == branch.capacity - 21
    assert torch.equal(root_cache.k, before)  # branches never wrote into the shared root


def test_memory_counts_the_shared_root_once(lm64):
    model, cfg = lm64.model, lm64.config
    root_cache = SequenceKV(cfg, model.dtype, "cpu", capacity=16)
    model.prefill(_ids(16, 3), root_cache)
    branches = [SharedPrefixKV(root_cache, 16, capacity=8) for _ in range(4)]
    row = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 8  # K and V, fp64
    assert kv_bytes(branches) == (16 + 4 * 8) * row
    assert kv_bytes([root_cache, root_cache]) == 16 * row


def test_the_shared_prefix_is_read_only(lm64):
    model, cfg = lm64.model, lm64.config
    root_cache = SequenceKV(cfg, model.dtype, "cpu", capacity=8)
    model.prefill(_ids(8, 4), root_cache)
    branch = SharedPrefixKV(root_cache, 8)
    with pytest.raises(ScheduleError, match="read-only"):
        model.prefill(torch.cat([_ids(8, 4), _ids(3, 5)]), branch)  # a full schedule rewrites the prefix
    with pytest.raises(ScheduleError, match="holds 8"):
        SharedPrefixKV(root_cache, 9)


def test_an_add_moves_own_rows_by_position_and_never_the_prefix(lm64):
    model, cfg = lm64.model, lm64.config
    root_cache = SequenceKV(cfg, model.dtype, "cpu", capacity=8)
    model.prefill(_ids(8, 4), root_cache)
    branch = SharedPrefixKV(root_cache, 8)
    model.prefill(torch.cat([_ids(8, 4), _ids(3, 5)]), branch, SuffixSchedule(8))
    slots = torch.tensor([9, 10])
    before_k, before_v = branch.gather(1, slots)
    before_8 = branch.gather(1, torch.tensor([8]))[0]  # the own row not named
    k_add = torch.full((cfg.num_kv_heads, 1, cfg.head_dim), 0.5, dtype=model.dtype)
    branch.add(1, slots, k_add, -k_add)
    after_k, after_v = branch.gather(1, slots)
    torch.testing.assert_close(after_k, before_k + 0.5)
    torch.testing.assert_close(after_v, before_v - 0.5)
    assert torch.equal(branch.gather(1, torch.tensor([8]))[0], before_8)
    with pytest.raises(ScheduleError, match="read-only"):
        branch.add(1, torch.tensor([7, 9]), k_add, k_add)
