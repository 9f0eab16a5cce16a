"""relay_anchors and its move pool: exact estimates on hand-made tensors, the learning calls, and a pool taught by
the very call it then serves reproducing full (the moves' layout, sign and re-rotation all checked at once)."""

import pytest
import torch

from kvrelay.cache.store import KVStore
from kvrelay.errors import ConfigError
from kvrelay.eval.fidelity import kl_first_token
from kvrelay.model.sampling import SamplingConfig
from kvrelay.reuse import get_method
from kvrelay.reuse.base import CallInput, SpanRef
from kvrelay.reuse.move_pool import MovePool
from tests.helpers import generate, publish, tiny_lm

ONE = SamplingConfig(max_new_tokens=1)
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


def test_bad_knobs_are_config_errors():
    for spec in ("relay_anchors[anchor_calls=0]", "relay_anchors[anchor_temp=0]", "relay_anchors[anchor_k=0]",
                 "relay_anchors[anchor_scale=3]", "relay_anchors[anchor_layer=-1]"):
        with pytest.raises(ConfigError):
            get_method(spec)


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("qwen2")


def _downstream(lm, store) -> CallInput:
    """An upstream call's sampled output, published, read by a downstream prompt in a new context."""
    up_prompt = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    up = generate(lm, up_prompt, "full", store, SamplingConfig(max_new_tokens=24, temperature=1.0, seed=0),
                  keep_cache=True)
    publish(store, "p/up", up, lm)
    head, tail = [1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5]
    return CallInput(head + up.output_ids + tail, [SpanRef(7, 31, "p/up", 20, "output", "up")], name="agent")


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])  # gemma3: per-layer RoPE bases and sliding windows
def test_learning_calls_then_anchors_reproduce_full(family):
    """With top_k=1 and a pool taught by this very call, every span token gets its own true move: naive plus
    anchors (the empty band) must then equal full, while naive alone does not."""
    lm = tiny_lm(family)
    store = KVStore(1 << 30)
    call = _downstream(lm, store)
    num_layers = lm.config.num_layers
    method = get_method(f"relay_anchors[anchor_calls=2,anchor_k=1,l_start={num_layers},l_det={num_layers},"
                        f"l_end={num_layers}]")
    for i in range(2):
        taught = generate(lm, call, method, store, ONE)
        assert taught.stats.fallback is not None and f"{i} of its 2 dense calls" in taught.stats.fallback
    assert method.pool.num_calls("agent/up") == 2
    full = generate(lm, call, "full", store, ONE, keep_cache=True)
    naive = generate(lm, call, "naive", store, ONE, keep_cache=True)
    out = generate(lm, call, method, store, ONE, keep_cache=True)
    assert out.stats.fallback is None
    assert out.stats.num_reused_tokens == naive.stats.num_reused_tokens == 24
    span = slice(7, 31)
    torch.testing.assert_close(out.cache.k[:, :, span], full.cache.k[:, :, span], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(out.cache.v[:, :, span], full.cache.v[:, :, span], atol=2e-3, rtol=2e-3)
    kl_naive = kl_first_token(full.first_logits, naive.first_logits)
    assert kl_naive > 1e-4
    assert kl_first_token(full.first_logits, out.first_logits) < kl_naive / 100


def test_relay_band_runs_on_top_of_the_anchors(lm):
    """With relay's band on top, the call computes span token-layers as relay does (not a fallback) and, the anchors
    being exact here, stays at full's output, which plain relay with the same band does not."""
    store = KVStore(1 << 30)
    call = _downstream(lm, store)
    method = get_method("relay_anchors[anchor_calls=1,anchor_k=1,l_start=0,l_det=1,l_end=2,top_r=0.2]")
    generate(lm, call, method, store, ONE)
    full = generate(lm, call, "full", store, ONE)
    out = generate(lm, call, method, store, ONE)
    plain = generate(lm, call, "relay[l_start=0,l_det=1,l_end=2,top_r=0.2]", store, ONE)
    assert out.stats.fallback is None
    naive = generate(lm, call, "naive", store, ONE)
    assert out.stats.num_computed_token_layers > naive.stats.num_computed_token_layers + 24  # the band's layer 0
    assert abs(out.stats.num_computed_token_layers - plain.stats.num_computed_token_layers) <= 6
    kl_plain = kl_first_token(full.first_logits, plain.first_logits)
    assert kl_first_token(full.first_logits, out.first_logits) < kl_plain / 100


def test_anchor_scale_zero_is_naive_exactly(lm):
    store = KVStore(1 << 30)
    call = _downstream(lm, store)
    n = lm.config.num_layers
    method = get_method(f"relay_anchors[anchor_calls=1,anchor_scale=0,l_start={n},l_det={n},l_end={n}]")
    generate(lm, call, method, store, ONE)
    out = generate(lm, call, method, store, ONE)
    assert out.stats.fallback is None
    assert torch.equal(out.first_logits, generate(lm, call, "naive", store, ONE).first_logits)


def test_a_taught_span_served_at_another_position_gets_its_moves_rerotated_there(lm):
    """The pool is matched on stored keys with RoPE undone at their own positions, and the moves are rotated for
    the new ones: a call that puts the same span 3 positions later gets, with top_k=1, each token's taught move
    rotated for its new position (read here with ``undo_rotary``/``apply_rotary``, not the method's ``shift_keys``)."""
    from kvrelay.model.rope import apply_rotary, undo_rotary

    store = KVStore(1 << 30)
    call = _downstream(lm, store)
    method = get_method("relay_anchors[anchor_calls=1,anchor_k=1,l_start=0,l_det=1,l_end=2]")
    generate(lm, call, method, store, ONE)
    moved = CallInput([11, 12, 13] + call.prompt_ids, [SpanRef(10, 34, "p/up", 20, "output", "up")], name="agent")
    plan = method.plan(moved, store, lm)
    assert plan.fallback is None and len(plan.patches) == 1 and plan.patches[0].dst_start == 10
    span, rope, layer = store.get("p/up"), lm.model.rope, method.pool.match_layer
    src_pos = torch.arange(span.start_pos + 20, span.start_pos + 44)
    cos, sin = rope.cos_sin(src_pos, torch.float32)
    keys_free = undo_rotary(span.k[layer, :, 20:44].float(), cos, sin)
    dk, dv = method.pool.estimate("agent/up", keys_free, lm.config.num_layers)
    cos, sin = rope.cos_sin(torch.arange(10, 34), torch.float32)
    torch.testing.assert_close(plan.patches[0].k[1:], apply_rotary(dk, cos, sin)[1:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(plan.patches[0].v[1:], dv[1:])
    assert not plan.patches[0].k[0].any()  # layer 0 untouched


def test_roles_follow_the_placeholder_when_an_earlier_span_is_gone(lm):
    """Two refs; the first one's span is not in the store: the second keeps its placeholder's role, and a span
    evicted between plan and observe teaches nothing."""
    store = KVStore(1 << 30)
    call = _downstream(lm, store)
    gone = SpanRef(0, 3, "p/never-published", 0, "input", "question")
    two = CallInput(call.prompt_ids, [gone, *call.refs], name="agent")
    spec = "relay_anchors[anchor_calls=1,l_start=0,l_det=1,l_end=2]"
    method = get_method(spec)
    generate(lm, two, method, store, ONE)
    assert method.pool.num_calls("agent/up") == 1 and method.pool.num_calls("agent/#0") == 0
    other = get_method(spec)
    plan = other.plan(call, store, lm)
    full = generate(lm, call, "full", store, ONE, keep_cache=True)
    store.remove("p/up")
    other.observe(call, plan, full.cache, store, lm)
    assert other.pool.num_calls("agent/up") == 0
