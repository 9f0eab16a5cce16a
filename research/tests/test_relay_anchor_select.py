"""research/relay_anchor_select.py: the anchors' scores of a call's span tokens, on a pool with a known answer."""

import torch
from relay_anchor_select import scores_of
from relay_oracle import fresh_prefill
from relay_oracle_shift import moves

from kvrelay.cache.store import KVStore
from kvrelay.model.sampling import SamplingConfig
from kvrelay.reuse import get_method
from kvrelay.reuse.spans import collect_reuse
from tests.helpers import generate, tiny_lm
from tests.reuse.test_relay_anchors import _downstream


def test_a_pool_taught_by_the_call_itself_scores_its_true_moves_and_no_residual():
    """anchor_k=1 over the raw pool of this very call: each token's estimate is its own true move (layer 0 left
    out), nothing is expected to be missed, and the expected move is the true move's squared norm."""
    lm = tiny_lm("qwen2")
    store = KVStore(1 << 30)
    call = _downstream(lm, store)
    n = lm.config.num_layers
    method = get_method(f"relay_anchors[anchor_calls=1,anchor_k=1,anchor_dim=0,anchor_centroids=0,l_start={n},"
                        f"l_det={n},l_end={n}]")
    generate(lm, call, method, store, SamplingConfig(max_new_tokens=1))
    reuse = collect_reuse(call, store, lm.fingerprint)
    _, fresh = fresh_prefill(lm, call)
    dk, dv = moves(lm, call, store, reuse, fresh)  # [L, Hkv, 24, hd]
    ak, av, residual, expected = scores_of(method, lm, call, store, reuse)
    assert ak.shape == dk.shape == (n, lm.config.num_kv_heads, 24, lm.config.head_dim)
    assert not ak[0].any() and not av[0].any()
    torch.testing.assert_close(ak[1:], dk[1:], atol=2e-3, rtol=2e-3)  # fp16 pool
    torch.testing.assert_close(av[1:], dv[1:], atol=2e-3, rtol=2e-3)
    assert float(residual.abs().max()) < 1e-3 * float(expected.mean())
    true_move = dk.pow(2).sum((0, 1, 3)) + dv.pow(2).sum((0, 1, 3))
    torch.testing.assert_close(expected, true_move, rtol=2e-3, atol=1e-4)
