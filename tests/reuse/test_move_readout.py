"""relay_anchors' ridge readout (``move_readout``): its layers and features, an exact fit on toy rows, the pool's side
rows kept with their tokens, and the readout taught by the very call it serves reproducing full."""

import math

import pytest
import torch

from kvrelay.cache.store import KVStore
from kvrelay.errors import ConfigError
from kvrelay.eval.fidelity import kl_first_token
from kvrelay.reuse import get_method
from kvrelay.reuse.move_pool import MovePool
from kvrelay.reuse.move_readout import MoveReadout, fit_readout, place_features, readout_layers
from kvrelay.reuse.spans import collect_reuse
from tests.helpers import generate, tiny_lm
from tests.reuse.test_relay_anchors import ONE, _downstream


def test_readout_layers_are_the_studys_on_smollm2_and_stay_inside_small_models():
    assert readout_layers(30) == (2, 4, 8, 15, 22, 29)
    assert readout_layers(18) == (2, 4, 8, 9, 13, 17)
    assert readout_layers(4) == (2, 3)
    assert readout_layers(2) == (1,)


def test_place_features_count_the_tokens_before_and_after_in_the_whole_span():
    torch.testing.assert_close(place_features(3, 2, 10), torch.tensor([[math.log(4), math.log(7)],
                                                                       [math.log(5), math.log(6)]]))


def test_fit_readout_recovers_an_affine_map_with_its_intercept():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 6, generator=gen)
    a, c = torch.randn(6, 10, generator=gen), 3 + torch.randn(10, generator=gen)
    y = x @ a + c
    readout = fit_readout(x.half(), y.half(), lam=1e-6)  # fp16 rows, as the pool keeps them
    test = torch.randn(5, 6, generator=gen)
    torch.testing.assert_close(readout(test), test @ a + c, atol=0.02, rtol=0.01)
    strong = fit_readout(x, y, lam=1e3)  # a strong penalty shrinks the slope towards the mean move
    torch.testing.assert_close(strong(test), c.expand(5, -1) + (x.mean(0) @ a), atol=0.2, rtol=0.05)
    with pytest.raises(ValueError):
        fit_readout(x, y[:10], lam=0.1)
    with pytest.raises(ValueError):
        MoveReadout(0.0)
    assert MoveReadout(0.1).predict("nobody", test) is None


def test_a_rank_cut_readout_keeps_the_directions_its_predictions_use():
    """Moves that vary along one output direction (plus a constant) are read back by a rank-1 readout as by the
    whole one; a rank-1 cut of moves along two directions is not."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(400, 6, generator=gen) * torch.tensor([3.0, 1, 1, 1, 0.3, 0.1])  # unequal feature scales
    a, u, w, c = (torch.randn(6, generator=gen), torch.randn(12, generator=gen), torch.randn(12, generator=gen),
                  torch.randn(12, generator=gen))
    y = (x @ a)[:, None] * u + c  # [400, 12]: one direction
    test = torch.randn(7, 6, generator=gen)
    whole, cut = fit_readout(x, y, lam=1e-6), fit_readout(x, y, lam=1e-6, rank=1)
    assert cut.out.shape == (1, 12) and cut.weight.shape == (6, 1) and cut.nbytes < whole.nbytes
    torch.testing.assert_close(cut(test), whole(test), atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(fit_readout(x, y, lam=1e-6, rank=6)(test), whole(test))  # rank >= F: whole
    y2 = y + (x @ torch.randn(6, generator=gen))[:, None] * w  # a second direction
    assert not torch.allclose(fit_readout(x, y2, lam=1e-6, rank=1)(test), fit_readout(x, y2, lam=1e-6)(test),
                              atol=0.1)
    torch.testing.assert_close(fit_readout(x, y2, lam=1e-6, rank=2)(test), fit_readout(x, y2, lam=1e-6)(test),
                               atol=1e-3, rtol=1e-3)


def test_the_pools_side_rows_stay_with_their_tokens():
    pool = MovePool(match_layer=0, max_tokens=6, top_k=1, temperature=0.1)
    gen = torch.Generator().manual_seed(1)
    sides = []
    for n in (3, 2, 4):  # the third call pushes the first out (9 > 6 tokens)
        side = torch.randn(n, 7, generator=gen)
        sides.append(side)
        pool.add("r", torch.randn(2, n, 4, generator=gen), torch.randn(3, 2, n, 4, generator=gen),
                 torch.randn(3, 2, n, 4, generator=gen), side)
    side, moves = pool.rows("r")
    assert side.shape == (6, 7) and moves.shape[0] == 6
    torch.testing.assert_close(side, torch.cat(sides[1:]).half())
    with pytest.raises(ValueError):  # a call without side rows in a role that has them
        pool.add("r", torch.randn(2, 1, 4), torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4))
    pool.freeze("r")
    assert pool._roles["r"].side is None  # freed with the raw tokens
    with pytest.raises(ValueError):
        pool.rows("r")


def test_bad_blend_knobs_are_config_errors():
    for spec in ("relay_anchors[anchor_blend=-0.1]", "relay_anchors[anchor_blend=1.5]",
                 "relay_anchors[anchor_ridge=0]", "relay_anchors[anchor_rank=-1]",
                 "relay_anchors[anchor_blend=0.5,anchor_ridge=inf]", "relay_anchors[anchor_rank=8]"):
        with pytest.raises(ConfigError):
            get_method(spec)


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])  # gemma3: per-layer RoPE bases
def test_a_readout_taught_by_the_call_it_serves_reproduces_full(family):
    """With the readout alone (anchor_blend=1) and almost no penalty, a role taught by this very call reads back each
    span token's true move (more features than tokens: the fit interpolates); naive plus the readout then matches
    full, and half the readout beside exact anchors (top_k=1) does too."""
    lm = tiny_lm(family)
    store = KVStore(1 << 30)
    call = _downstream(lm, store)
    n = lm.config.num_layers
    full = generate(lm, call, "full", store, ONE, keep_cache=True)
    naive = generate(lm, call, "naive", store, ONE, keep_cache=True)
    kl_naive = kl_first_token(full.first_logits, naive.first_logits)
    assert kl_naive > 1e-4
    span = slice(7, 31)

    def worst(out, kv: str) -> float:  # the largest |error| of the span's K or V against full's
        return float((getattr(out.cache, kv)[:, :, span] - getattr(full.cache, kv)[:, :, span]).abs().max())
    for blend in (1.0, 0.5):
        method = get_method(f"relay_anchors[anchor_calls=1,anchor_k=1,anchor_blend={blend},anchor_ridge=1e-7,"
                            f"l_start={n},l_det={n},l_end={n}]")
        generate(lm, call, method, store, ONE)  # teaches, fits and freezes agent/up
        num_features = 2 * len(readout_layers(n)) * lm.config.num_kv_heads * lm.config.head_dim + 2
        num_moves = 2 * n * lm.config.num_kv_heads * lm.config.head_dim
        assert method.settings(lm)["readout"] == {"num_roles": 1,
                                                  "nbytes": 4 * (num_features * num_moves + num_features + num_moves)}
        out = generate(lm, call, method, store, ONE, keep_cache=True)
        assert out.stats.fallback is None
        for kv in "kv":  # the fp16 pool's rounding left, against naive's whole move
            assert worst(out, kv) < worst(naive, kv) / 50, (kv, worst(out, kv), worst(naive, kv))
        assert kl_first_token(full.first_logits, out.first_logits) < kl_naive / 100


def test_the_blend_mixes_the_two_estimates_by_its_share():
    """anchor_blend=b's moves are (1 - b) x the anchors' plus b x the readout's, on a role whose readout is
    cut to its mean move (its weight zeroed), so the two differ."""
    lm = tiny_lm("qwen2")
    store = KVStore(1 << 30)
    call = _downstream(lm, store)
    n = lm.config.num_layers
    method = get_method(f"relay_anchors[anchor_calls=1,anchor_k=1,anchor_blend=0.25,l_start={n},l_det={n},"
                        f"l_end={n},anchor_prepare=0]")
    generate(lm, call, method, store, ONE)
    load = collect_reuse(call, store, lm.fingerprint).approx[0]
    span = store.get(load.span_id)
    readout = method.readout._roles["agent/up"]
    readout.weight.zero_()  # every token's readout: the mean move
    blended = method._estimate("agent/up", span, load, lm)
    method.readout = None
    alone = method._estimate("agent/up", span, load, lm)
    mean = readout.y_mean.view(2 * n, lm.config.num_kv_heads, 1, lm.config.head_dim)  # [2L, Hkv, 1, hd]
    for i, (got, want) in enumerate(zip(blended[:2], alone[:2], strict=True)):
        expected = 0.75 * want + 0.25 * mean[i * n : (i + 1) * n]
        expected[0] = 0
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
