"""Attention over keys held as runs (a shared prefix read in place) equals attention over one run."""

import pytest
import torch

from kvrelay.model.layers import attention, attention_runs, visible_mask


def _qkv(n_q: int, n_k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(4, n_q, 8, generator=g)  # [H, n, hd], 2 query heads per kv head
    return q, torch.randn(2, n_k, 8, generator=g), torch.randn(2, n_k, 8, generator=g)


@pytest.mark.parametrize("cuts", [(7,), (3, 11), (1, 2, 15)])
@pytest.mark.parametrize("window", [None, 4])
def test_runs_equal_one_run(cuts, window):
    """Queries at the end of a 20-token sequence (a reused prefix, then new tokens); with a window of 4
    the rows see none of the first runs' keys (the kernel reports lse 0 there, not -inf)."""
    q, k, v = _qkv(5, 20)
    mask = visible_mask(torch.arange(15, 20), 20, window)
    edges = [0, *cuts, 20]
    runs = [(k[:, a:b], v[:, a:b]) for a, b in zip(edges, edges[1:], strict=False)]
    ref = attention(q, k, v, mask, False)
    torch.testing.assert_close(attention_runs(q, runs, mask, False), ref, atol=1e-6, rtol=0)


def test_one_decode_query_without_a_mask():
    q, k, v = _qkv(1, 30, seed=1)
    runs = [(k[:, :12], v[:, :12]), (k[:, 12:], v[:, 12:])]
    torch.testing.assert_close(attention_runs(q, runs, None, False), attention(q, k, v, None, False),
                               atol=1e-6, rtol=0)
