"""research/relay_anchor_estimators.py: the features, the ridge fit and the shares, on toy tensors."""

import math

import torch
from relay_anchor_estimators import (
    Explained,
    fit_ridge,
    flat_moves,
    low_rank,
    oracle_features,
    place_features,
    split_moves,
    token_features,
    unflat_moves,
)

L, HKV, N, HD = 4, 2, 5, 3


def test_flat_moves_match_the_pools_row_layout_and_split_back():
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(L, HKV, N, HD, generator=gen), torch.randn(L, HKV, N, HD, generator=gen)
    flat = flat_moves(k, v)
    assert flat.shape == (N, 2 * L * HKV * HD)
    # token 3, V at layer 2, head 1, channel 0: after all of K (L x Hkv x hd) and V's layers 0-1
    assert flat[3, L * HKV * HD + 2 * HKV * HD + 1 * HD + 0] == v[2, 1, 3, 0]
    assert flat[1, 1 * HKV * HD + 0 * HD + 2] == k[1, 0, 1, 2]
    sk, sv = split_moves(flat, L)
    torch.testing.assert_close(sk, k.permute(2, 0, 1, 3).flatten(2))  # [n, L, Hkv hd]
    torch.testing.assert_close(sv, v.permute(2, 0, 1, 3).flatten(2))


def test_place_features_count_tokens_before_and_after():
    feats = place_features(4)
    torch.testing.assert_close(feats[:, 0], torch.log1p(torch.tensor([0.0, 1, 2, 3])))
    torch.testing.assert_close(feats[:, 1], torch.log1p(torch.tensor([3.0, 2, 1, 0])))


def test_token_features_unit_norm_each_layer_then_place():
    gen = torch.Generator().manual_seed(1)
    keys, values = torch.randn(2, HKV, N, HD, generator=gen), 5 * torch.randn(2, HKV, N, HD, generator=gen)
    feats = token_features(keys, values)
    width = HKV * HD
    assert feats.shape == (N, 4 * width + 2)
    for block in range(4):  # K at layers 0, 1, then V at layers 0, 1: each unit norm per token
        torch.testing.assert_close(feats[:, block * width : (block + 1) * width].norm(dim=1), torch.ones(N))
    # token 2's V block at layer 1 is its values over heads and channels, normalized
    expected = values[1, :, 2].flatten() / values[1, :, 2].flatten().norm()
    torch.testing.assert_close(feats[2, 3 * width : 4 * width], expected)
    torch.testing.assert_close(feats[:, -2:], place_features(N))


def test_ridge_recovers_a_linear_map_with_intercept():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(400, 6, generator=gen) + 3.0  # off-center: the intercept must absorb it
    w, b = torch.randn(6, 5, generator=gen), torch.randn(5, generator=gen)
    y = (x @ w + b).half()
    model = fit_ridge(x, y, lam=1e-6, chunk=64)  # chunks that do not divide the rows
    torch.testing.assert_close(model(x), y.float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(model.weight, w, atol=2e-2, rtol=0)


def test_ridge_penalty_shrinks_toward_the_mean():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(200, 4, generator=gen)
    y = x @ torch.randn(4, 3, generator=gen) + 1.0
    strong = fit_ridge(x, y, lam=1e6)
    torch.testing.assert_close(strong(x), y.mean(0).expand(200, 3), atol=1e-3, rtol=0)


def test_explained_is_one_minus_miss_over_total_per_kind_from_a_layer():
    true = torch.zeros(2, 2 * L * 1 * 1)  # n = 2, Hkv hd = 1: K layers 0-3, then V layers 0-3
    true[:, :L] = torch.tensor([9.0, 1.0, 2.0, 2.0])  # K (layer 0 is ignored from layer 1 up)
    true[:, L:] = torch.tensor([0.0, 3.0, 0.0, 4.0])  # V
    est = true.clone()
    est[:, 1] = 0.0  # K misses layer 1 entirely: 1 of 1 + 4 + 4
    est[:, L + 3] = 2.0  # V misses half of layer 3: 4 of 9 + 16
    acc = Explained(from_layer=1)
    acc.add(true, est, L)
    shares = acc.shares()
    assert math.isclose(shares["K"], 1 - 1 / 9, rel_tol=1e-6)
    assert math.isclose(shares["V"], 1 - 4 / 25, rel_tol=1e-6)
    upper = Explained(from_layer=2)
    upper.add(true, est, L)
    assert math.isclose(upper.shares()["K"], 1.0) and math.isclose(upper.shares()["V"], 1 - 4 / 16, rel_tol=1e-6)


def test_oracle_features_append_the_true_lower_layers_only():
    gen = torch.Generator().manual_seed(4)
    k, v = torch.randn(L, HKV, N, HD, generator=gen), torch.randn(L, HKV, N, HD, generator=gen)
    feat = torch.randn(N, 7, generator=gen)
    out = oracle_features(feat, flat_moves(k, v), L, 2)
    width = HKV * HD
    assert out.shape == (N, 7 + 2 * 2 * width)
    torch.testing.assert_close(out[:, :7], feat)
    torch.testing.assert_close(out[:, 7 : 7 + width], k[1].permute(1, 0, 2).flatten(1) / 10)  # K layer 1
    torch.testing.assert_close(out[:, 7 + 2 * width : 7 + 3 * width], v[1].permute(1, 0, 2).flatten(1) / 10)


def test_low_rank_keeps_the_directions_its_predictions_use():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(300, 6, generator=gen)
    w = torch.randn(6, 2, generator=gen) @ torch.randn(2, 8, generator=gen)  # rank 2 over 8 outputs
    model = fit_ridge(x, x @ w + 0.5, lam=1e-6)
    kept = low_rank(model, x, 2)
    torch.testing.assert_close(kept(x), model(x), atol=1e-3, rtol=0)
    one = low_rank(model, x, 1)  # one direction: the predictions' largest, so it keeps more than half their variance
    spread = (model(x) - model.y_mean).square().sum()
    assert (one(x) - model(x)).square().sum() < 0.5 * spread
    assert not torch.allclose(one(x), model(x), atol=1e-2)


def test_low_rank_weighs_outputs_by_their_spread_not_the_features_variance():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(500, 2, generator=gen) * torch.tensor([2.0, 1.0])
    w = torch.tensor([[1.0, 0.0], [0.0, 3.0]])  # output 0 spreads 2 x 1 = 2, output 1 spreads 1 x 3 = 3
    model = fit_ridge(x, x @ w, lam=1e-9)
    one = low_rank(model, x, 1)  # output 1 is kept (a metric C instead of C^1/2 would rank output 0 first: 4 > 3)
    full, cut = model(x), one(x)
    assert (cut[:, 1] - full[:, 1]).square().mean() < 0.01 * full[:, 1].var()  # (the sample's correlation leaks a
    assert cut[:, 0].var() < 0.01 * full[:, 0].var()  # little of output 0 into the kept direction)


def test_unflat_moves_undo_flat_moves():
    gen = torch.Generator().manual_seed(8)
    k, v = torch.randn(L, HKV, N, HD, generator=gen), torch.randn(L, HKV, N, HD, generator=gen)
    back_k, back_v = unflat_moves(flat_moves(k, v), L, HD)
    assert torch.equal(back_k, k) and torch.equal(back_v, v)


def test_low_rank_ranks_directions_by_the_predictions_not_the_weights():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(500, 2, generator=gen) * torch.tensor([10.0, 0.1])  # a wide feature and a narrow one
    w = torch.tensor([[0.1, 0.0, 0.0], [0.0, 5.0, 0.0]])  # the narrow feature has the bigger weight
    model = fit_ridge(x, x @ w, lam=1e-9)
    one = low_rank(model, x, 1)  # output 0 varies 4x more (1 against 0.25): it is the one kept
    # (the sample's slight correlation between the features mixes a little of output 1 in)
    torch.testing.assert_close(one(x)[:, 0], model(x)[:, 0], atol=2e-2, rtol=0)
    torch.testing.assert_close(one(x)[:, 1], model.y_mean[1].expand(500), atol=2e-2, rtol=0)
