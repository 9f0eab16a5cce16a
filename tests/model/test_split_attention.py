"""Attention in key parts, merged by log-sum-exp, equals attention over all keys at once."""

import torch

from kvrelay.model.layers import attention, visible_mask
from kvrelay.model.split_attention import attention_parts, fold_mask, fold_queries

H, HKV, HD = 6, 2, 8


def _parts(q, k, v, mask, bounds):
    group = q.shape[0] // k.shape[0]
    folded = fold_queries(q, k.shape[0])
    queries, keys, values, masks = [], [], [], []
    for a, b in bounds:
        part = fold_mask(mask[:, a:b], group, q.dtype)
        if part is None:
            continue
        queries.append(folded)
        keys.append(k[:, a:b])
        values.append(v[:, a:b])
        masks.append(part)
    return attention_parts(queries, keys, values, masks, q.shape[0])


def test_parts_merge_to_whole_attention_with_rows_that_see_no_key_of_a_part():
    g = torch.Generator().manual_seed(0)
    n_keys = 40
    q_pos = torch.tensor([3, 4, 17, 30, 39])  # query 3 and 4 see nothing of the parts from 10 on
    q = torch.randn(H, q_pos.numel(), HD, generator=g)
    k, v = torch.randn(HKV, n_keys, HD, generator=g), torch.randn(HKV, n_keys, HD, generator=g)
    for window in (None, 12):  # a sliding window too: query 30 sees nothing of [0, 10)
        mask = visible_mask(q_pos, n_keys, window)
        whole = attention(q, k, v, mask, False)
        got = _parts(q, k, v, mask, [(0, 10), (10, 25), (25, 40)])
        torch.testing.assert_close(got, whole, atol=1e-5, rtol=0)


def test_a_part_no_query_sees_is_left_out():
    assert fold_mask(torch.zeros(3, 5, dtype=torch.bool), 2, torch.float32) is None
    part = fold_mask(torch.tensor([[True, False], [True, True]]), 3, torch.float32)
    assert part.sees_any is None  # every row sees a key: no fix-up needed
    assert part.additive.shape == (6, 2) and part.additive[0, 1] == float("-inf") and part.additive[1, 1] == 0
