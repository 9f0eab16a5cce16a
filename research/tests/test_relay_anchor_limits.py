"""research/relay_anchor_limits.py: the hand-set span K/V of each variant, on toy tensors."""

import pytest
import torch
from relay_anchor_limits import layer_blocks, shares, top_mask, variants

L, HKV, M, HD = 7, 2, 10, 4


def _moves(seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(L, HKV, M, HD, generator=gen) for _ in range(4))  # dk, dv, ak, av


def test_layer_blocks_cover_layers_1_up_once():
    assert layer_blocks(30) == [(1, 5), (6, 10), (11, 15), (16, 20), (21, 25), (26, 29)]
    assert layer_blocks(7, 5) == [(1, 5), (6, 6)]


def test_top_mask_keeps_the_highest_and_at_least_one():
    score = torch.tensor([0.1, 0.9, 0.5, 0.7])
    assert top_mask(score, 0.5).tolist() == [False, True, False, True]
    assert top_mask(score, 0.01).tolist() == [False, True, False, False]


def test_each_variant_sets_what_it_names():
    dk, dv, ak, av = _moves()
    residual = torch.arange(M, dtype=torch.float32)  # tokens 8, 9 are the top 20%
    out = variants(dk, dv, ak, av, residual, 0.2)
    assert torch.equal(out["true K"][0], dk) and torch.equal(out["true K"][1], av)
    assert torch.equal(out["true V"][0], ak) and torch.equal(out["true V"][1], dv)
    k, v = out["true layers 6-6"]
    assert torch.equal(k[6], dk[6]) and torch.equal(v[6], dv[6])
    assert torch.equal(k[:6], ak[:6]) and torch.equal(v[:6], av[:6])
    torch.testing.assert_close(out["a quarter of the residual"][0], 0.75 * ak + 0.25 * dk)
    # the call mean x1 leaves a residual that averages to zero over the span tokens, per layer, head and channel
    k, v = out["call mean x1.0"]
    torch.testing.assert_close((dk - k).mean(2), torch.zeros(L, HKV, HD), atol=1e-6, rtol=0)
    torch.testing.assert_close((dv - v).mean(2), torch.zeros(L, HKV, HD), atol=1e-6, rtol=0)
    k, v = out["top 0.2 true + band mean x0.0"]
    assert torch.equal(k[:, :, 8:], dk[:, :, 8:]) and torch.equal(k[:, :, :8], ak[:, :, :8])
    k, v = out["top 0.2 true + band mean x1.0"]
    band_mean = (dv - av)[:, :, 8:].mean(2, keepdim=True)
    torch.testing.assert_close(v[:, :, :8], av[:, :, :8] + band_mean)
    assert torch.equal(v[:, :, 8:], dv[:, :, 8:])


def test_shares_of_a_perfect_and_of_a_shifted_estimate():
    dk, dv, ak, av = _moves(1)
    perfect = shares(dk, dv, dk, dv)
    assert perfect["K explained"] == 1 and perfect["V explained"] == 1
    shift = torch.randn(L, HKV, 1, HD)  # the same residual on every token: the call mean explains all of it
    shifted = shares(dk, dv, dk - shift, dv + shift)
    assert shifted["K residual by the call mean"] == pytest.approx(1, abs=1e-5)
    assert shifted["V residual by the call mean"] == pytest.approx(1, abs=1e-5)
    assert shifted["K explained"] == pytest.approx(
        1 - float(shift.expand(L, HKV, M, HD)[1:].pow(2).sum() / dk[1:].pow(2).sum()), rel=1e-5)
