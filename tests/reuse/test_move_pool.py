"""MovePool and its index: exact estimates, spreads and residuals on hand-made tensors."""

import pytest
import torch

from kvrelay.reuse import move_pool
from kvrelay.reuse.move_pool import MovePool

L, HKV, HD = 3, 2, 4


def _moves(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(HKV, n, HD, generator=gen), torch.randn(L, HKV, n, HD, generator=gen),
            torch.randn(L, HKV, n, HD, generator=gen))


def test_pool_top1_returns_the_matching_tokens_moves():
    pool = MovePool(match_layer=1, max_tokens=100, top_k=1, temperature=0.02)
    feat, dk, dv = _moves(5, 0)
    pool.add("a#0", feat, dk, dv)
    est_k, est_v = pool.estimate("a#0", feat[:, [3, 0]], L)  # tokens 3 and 0 again
    torch.testing.assert_close(est_k, dk[:, :, [3, 0]].half().float())
    torch.testing.assert_close(est_v, dv[:, :, [3, 0]].half().float())
    assert pool.estimate("b#0", feat, L) is None  # another role has no pool


def test_pool_mixes_its_top_k_by_softmax_of_cosine():
    pool = MovePool(match_layer=0, max_tokens=100, top_k=2, temperature=0.5)
    feat = torch.zeros(HKV, 3, HD)
    feat[0, 0, 0], feat[0, 1, 1], feat[0, 2, 2] = 1.0, 1.0, 1.0  # orthogonal unit features
    dk = torch.arange(3.0).view(1, 1, 3, 1).expand(L, HKV, 3, HD).contiguous()  # token j moved by j
    pool.add("r", feat, dk, -dk)
    query = torch.zeros(HKV, 1, HD)
    query[0, 0, 0], query[0, 0, 1] = 0.8, 0.6  # cos 0.8 to token 0, 0.6 to token 1, 0 to token 2
    est_k, est_v = pool.estimate("r", query, L)
    w = torch.softmax(torch.tensor([0.8, 0.6]) / 0.5, 0)
    expected = float(w[0] * 0 + w[1] * 1)
    assert est_k.shape == (L, HKV, 1, HD)
    torch.testing.assert_close(est_k, torch.full((L, HKV, 1, HD), expected), atol=2e-3, rtol=0)
    torch.testing.assert_close(est_v, -est_k)


def test_pool_drops_its_oldest_calls_past_max_tokens():
    pool = MovePool(match_layer=0, max_tokens=8, top_k=1, temperature=0.02)
    for seed in range(3):
        pool.add("r", *_moves(5, seed))
    assert pool.num_calls("r") == 3
    assert pool.num_tokens("r") == 5  # 15 > 8 and 10 > 8: the first two calls' tokens are gone
    feat, dk, _ = _moves(5, 2)
    torch.testing.assert_close(pool.estimate("r", feat, L)[0], dk.half().float())


def test_index_projects_on_the_features_top_principal_directions():
    """Features spread along two axes, with a small ripple on a third: a 2-dim index matches by the two axes alone
    (the query nearest token 0 there, but nearest token 1 in the full space, gets token 0's move)."""
    feat = torch.zeros(1, 6, 4)
    angles = torch.linspace(0, 3, 6)
    feat[0, :, 0], feat[0, :, 1] = torch.cos(angles), torch.sin(angles)
    feat[0, :, 2] = torch.tensor([0.0, 0.3, 0.0, 0.0, 0.0, 0.0])
    moves = torch.arange(6.0).view(1, 1, 6, 1).expand(L, 1, 6, 4).contiguous()  # token j moved by j
    query = feat[:, [0]].clone()
    query[0, 0, 1] += 0.3  # between tokens 0 and 1 on the circle (nearer 0) ...
    query[0, 0, 2] = 0.3  # ... but with token 1's ripple
    for dim, expected in ((2, 0.0), (0, 1.0)):
        pool = MovePool(match_layer=0, max_tokens=100, top_k=1, temperature=0.02, dim=dim)
        pool.add("r", feat, moves, -moves)
        est_k, _ = pool.estimate("r", query, L)
        assert float(est_k[0, 0, 0, 0]) == expected, dim
        index = pool.index("r")
        unit = torch.nn.functional.normalize(feat[0], dim=-1).half().float()  # pooled in fp16
        if dim == 0:
            assert index.basis is None and torch.equal(index.keys, unit)  # the unit-norm features themselves
            continue
        torch.testing.assert_close(index.basis.T @ index.basis, torch.eye(2))  # orthonormal directions
        centered = unit - unit.mean(0)
        torch.testing.assert_close(index.keys, torch.nn.functional.normalize(centered @ index.basis, dim=-1))
        # the two directions hold nearly all the centered features' spread (the ripple is the rest)
        assert float((centered @ index.basis).pow(2).sum() / centered.pow(2).sum()) > 0.97


def test_raw_index_is_the_cosine_top_k_over_every_pooled_token():
    """dim=0, num_centroids=0: the estimate is the softmax(cos / t) mean of the top-k pooled tokens by the cosine of
    their features (a reference written here, not the pool's path)."""
    feat, dk, dv = _moves(30, 3)
    pool = MovePool(match_layer=0, max_tokens=100, top_k=4, temperature=0.1)
    pool.add("r", feat[:, :20], dk[:, :, :20], dv[:, :, :20])
    est_k, est_v = pool.estimate("r", feat[:, 20:], L)
    flat = torch.nn.functional.normalize(feat.transpose(0, 1).flatten(1), dim=-1)  # [30, Hkv * hd]
    sim = flat[20:] @ flat[:20].half().float().T
    top = sim.topk(4, dim=-1)
    weight = torch.softmax(top.values / 0.1, -1)  # [10, 4]
    ref_k = (dk[:, :, :20].half().float()[:, :, top.indices] * weight[None, None, :, :, None]).sum(3)
    torch.testing.assert_close(est_k, ref_k, atol=5e-3, rtol=0)
    assert est_v.shape == ref_k.shape


def test_kmeans_index_rows_carry_their_members_mean_move():
    """Two tight groups of tokens and two clusters: the index has two rows, each the mean move of its group."""
    gen = torch.Generator().manual_seed(0)
    centers = torch.eye(HD)[:2]  # two orthogonal directions
    groups = torch.tensor([0, 1, 0, 0, 1, 1, 0])
    feat = (centers[groups] + 0.01 * torch.randn(7, HD, generator=gen)).unsqueeze(0).expand(HKV, 7, HD).contiguous()
    dk = torch.randn(L, HKV, 7, HD, generator=gen)
    pool = MovePool(match_layer=0, max_tokens=100, top_k=1, temperature=0.02, num_centroids=2)
    pool.add("r", feat, dk, 2 * dk)
    query = centers[[1, 0]].unsqueeze(0).expand(HKV, 2, HD).contiguous()
    est_k, est_v = pool.estimate("r", query, L)
    assert pool.num_entries("r") == 2
    for i, group in enumerate((1, 0)):
        mean = dk[:, :, groups == group].half().float().mean(2)
        torch.testing.assert_close(est_k[:, :, i], mean, atol=2e-3, rtol=0)
        torch.testing.assert_close(est_v[:, :, i], 2 * mean, atol=4e-3, rtol=0)


def test_kmeans_seeds_empty_clusters_again_when_tokens_repeat():
    """Repeated tokens make duplicate seeds; the cluster they leave empty is seeded again, so three distinct features
    give three rows although two of the evenly spaced seeds are copies of one (feature 0's second cluster would stay
    empty, ties going to the first, and feature 1, nearer feature 2's seed, would share its cluster)."""
    base = torch.eye(HD)[:3]
    base[1] = torch.nn.functional.normalize(torch.tensor([0.0, 1.0, 1.0, 0.0]), dim=0)
    rows = torch.tensor([0] * 8 + [1, 2])  # seeds at rows 0, 4 and 9: feature 0 twice, feature 2
    feat = base[rows].unsqueeze(0).expand(HKV, 10, HD).contiguous()
    dk = torch.arange(10.0).view(1, 1, 10, 1).expand(L, HKV, 10, HD).contiguous()
    pool = MovePool(match_layer=0, max_tokens=100, top_k=1, temperature=0.02, num_centroids=3)
    pool.add("r", feat, dk, dk)
    est_k, _ = pool.estimate("r", base.unsqueeze(0).expand(HKV, 3, HD).contiguous(), L)
    assert pool.num_entries("r") == 3
    torch.testing.assert_close(est_k[0, 0, :, 0], torch.tensor([3.5, 8.0, 9.0]))  # each feature's own mean move


def test_kmeans_index_rows_carry_their_members_spread_about_their_move():
    """Each cluster row's spread is its members' mean squared distance from the row's (fp16) mean move, over every
    value of K and V; a raw index's rows (one token each) have none."""
    gen = torch.Generator().manual_seed(1)
    groups = torch.tensor([0, 1, 0, 0, 1, 1, 0])
    feat = (torch.eye(HD)[:2][groups] + 0.01 * torch.randn(7, HD, generator=gen)).unsqueeze(0).expand(HKV, 7, HD)
    dk, dv = torch.randn(L, HKV, 7, HD, generator=gen), torch.randn(L, HKV, 7, HD, generator=gen)
    pool = MovePool(match_layer=0, max_tokens=100, top_k=1, temperature=0.02, num_centroids=2)
    pool.add("r", feat.contiguous(), dk, dv)
    index = pool.index("r")
    both = torch.cat([dk, dv]).permute(2, 0, 1, 3).reshape(7, -1).half().float()  # [7, 2 L Hkv hd] as pooled
    centers = torch.eye(HD)[:2].unsqueeze(0).expand(HKV, 2, HD).contiguous()
    row_of_group = (index.match(pool.features(centers)) @ index.keys.T).argmax(-1)  # [2]
    assert sorted(row_of_group.tolist()) == [0, 1]
    for group, row in enumerate(row_of_group.tolist()):
        members = both[groups == group]
        mean = index.moves[row].float()
        torch.testing.assert_close(mean, members.mean(0), atol=2e-3, rtol=0)
        torch.testing.assert_close(index.spread[row], (members - mean).pow(2).sum(1).mean(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(index.move_sq[row], mean.pow(2).sum())
    raw = MovePool(match_layer=0, max_tokens=100, top_k=1, temperature=0.02)
    raw.add("r", feat.contiguous(), dk, dv)
    assert not raw.index("r").spread.any()
    torch.testing.assert_close(raw.index("r").move_sq, both.pow(2).sum(1))


@pytest.mark.parametrize("num_centroids", [0, 3])
def test_residual_is_the_mixtures_spread_about_the_estimate(num_centroids):
    """estimate_with_residual's per-token residual is sum_i w_i (spread_i + |move_i - estimate|^2) over the mixed
    rows (written here in that form, not the pool's), and its moves are ``estimate``'s."""
    feat, dk, dv = _moves(12, 4)
    pool = MovePool(match_layer=0, max_tokens=100, top_k=3, temperature=0.3, num_centroids=num_centroids)
    pool.add("r", feat[:, :10], dk[:, :, :10], dv[:, :, :10])
    query = feat[:, 10:]
    est_k, est_v, residual = pool.estimate_with_residual("r", query, L)
    index = pool.index("r")
    top = (index.match(pool.features(query)) @ index.keys.T).topk(3, dim=-1)
    weight = torch.softmax(top.values / 0.3, -1)  # [2, 3]
    est = torch.cat([est_k, est_v]).permute(2, 0, 1, 3).reshape(2, -1)  # [2, 2 L Hkv hd]
    rows = index.moves.float()[top.indices]  # [2, 3, 2 L Hkv hd]
    expected = (weight * (index.spread[top.indices] + (rows - est[:, None]).pow(2).sum(-1))).sum(-1)
    torch.testing.assert_close(residual, expected, rtol=1e-3, atol=1e-3)
    assert float(residual.min()) > 0.1  # the rows disagree: the estimate misses something


def test_a_cluster_left_empty_shifts_the_rows_its_spread_goes_to(monkeypatch):
    """k-means may leave a cluster empty (fewer distinct keys than clusters): the index drops it, and each remaining
    row's spread is still its own members' (cluster 1 of 3 empty here: clusters 0 and 2 become rows 0 and 1)."""
    feat, dk, dv = _moves(6, 5)
    assignment = torch.tensor([2, 0, 2, 2, 0, 2])
    monkeypatch.setattr(move_pool, "_kmeans", lambda keys, num: (torch.eye(3, keys.shape[1]), assignment))
    pool = MovePool(match_layer=0, max_tokens=100, top_k=1, temperature=0.02, num_centroids=3)
    pool.add("r", feat, dk, dv)
    index = pool.index("r")
    assert index.keys.shape[0] == 2
    both = torch.cat([dk, dv]).permute(2, 0, 1, 3).reshape(6, -1).half().float()  # [6, 2 L Hkv hd] as pooled
    for row, cluster in enumerate((0, 2)):
        members = both[assignment == cluster]
        torch.testing.assert_close(index.moves[row].float(), members.mean(0), atol=2e-3, rtol=0)
        mean = index.moves[row].float()
        torch.testing.assert_close(index.spread[row], (members - mean).pow(2).sum(1).mean(), rtol=1e-5, atol=1e-5)


def test_freeze_keeps_the_index_and_frees_the_tokens():
    pool = MovePool(match_layer=1, max_tokens=100, top_k=2, temperature=0.1, dim=3, num_centroids=4)
    feat, dk, dv = _moves(9, 0)
    pool.add("r", feat, dk, dv)
    before = pool.estimate("r", feat, L)
    pool.freeze("r")
    assert pool.num_tokens("r") == 0 and pool.num_entries("r") == 4
    role = pool._roles["r"]
    assert role.feat.untyped_storage().nbytes() == 0 and role.moves.untyped_storage().nbytes() == 0  # freed
    # 4 rows of 3-dim float32 keys, fp16 moves and two float32 scalars; the mean and the basis (float32)
    # per row: its key, move, spread and squared move norm
    assert pool.nbytes == 4 * (3 * 4 + 2 * L * HKV * HD * 2 + 2 * 4) + (HKV * HD) * 4 + (HKV * HD) * 3 * 4
    for a, b in zip(pool.estimate("r", feat, L), before, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="frozen"):
        pool.add("r", feat, dk, dv)
