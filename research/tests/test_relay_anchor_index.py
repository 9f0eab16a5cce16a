"""research/relay_anchor_index.py: the explained share of the move, on toy spans with known answers."""

import torch
from relay_anchor_index import SpanMoves, score

L, HKV, HD = 3, 2, 4


def _span(problem: str, n: int, move: torch.Tensor, seed: int) -> SpanMoves:
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(HKV, n, HD, generator=gen)
    k_move = move.view(L, 1, 1, HD).expand(L, HKV, n, HD).half()
    return SpanMoves(problem, "agent#0", keys, k_move, -k_move)


def test_a_pool_whose_tokens_all_moved_alike_explains_the_move_whole_or_by_sign():
    move = torch.arange(L * HD, dtype=torch.float32).view(L, HD) + 1
    move[0] = 0  # layer 0 does not move, and is not scored
    pool = [_span("p0", 9, move, 0), _span("p1", 7, move, 1)]
    for dim, centroids in ((0, 0), (2, 3)):  # any index mixes copies of the same move: the estimate is that move
        same = score(pool, [_span("q", 5, move, 2)], L, 0, dim, centroids, 0.05)
        for kv in ("k", "v"):
            assert abs(same[kv]["explained_at_1"] - 1) < 1e-3 and abs(same[kv]["best_scale"] - 1) < 1e-3
        assert max(same["index_rows"].values()) == (16 if centroids == 0 else 3)
    flipped = score(pool, [_span("q", 5, -move, 2)], L, 0, 0, 0, 0.05)
    # |(-m) - m|^2 / |m|^2 = 4: explained at 1 is 1 - 4; at the best scale (-1) all of it
    assert abs(flipped["k"]["explained_at_1"] + 3) < 1e-3
    assert abs(flipped["k"]["best_scale"] + 1) < 1e-3 and abs(flipped["k"]["explained_at_best"] - 1) < 1e-3
