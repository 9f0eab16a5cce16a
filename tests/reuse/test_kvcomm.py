"""KVCOMM on a tiny model and on hand-made tensors: exact estimate with one identical anchor, the
softmax weights, pool eviction, the gate's fallback path and what the bench counts."""

import math

import pytest
import torch

from kvrelay.cache.store import KVStore
from kvrelay.errors import ConfigError
from kvrelay.eval.fidelity import kl_first_token
from kvrelay.eval.harness import Bench, BenchConfig
from kvrelay.model.sampling import SamplingConfig
from kvrelay.reuse import get_method
from kvrelay.reuse.anchors import (
    Anchor,
    AnchorPool,
    l2_distances,
    mix,
    mixing_weights,
    normalized_entropy,
    value_distances,
)
from kvrelay.reuse.base import CallInput, SpanRef
from tests.helpers import generate, publish, tiny_lm

ONE = SamplingConfig(max_new_tokens=1)


def _downstream(lm, store, seed: int, head_len: int = 7, tail_len: int = 5, up_name: str = "up",
                temperature: float = 0.0) -> CallInput:
    """An upstream call (published as ``up_name``) and a downstream prompt: template head + its output + tail.
    The tiny random model's greedy outputs repeat one token; ``temperature`` > 0 samples distinct texts."""
    gen = torch.Generator().manual_seed(seed)
    up_prompt = torch.randint(0, 256, (20,), generator=gen).tolist()
    sampling = SamplingConfig(max_new_tokens=24, temperature=temperature, seed=seed)
    up = generate(lm, up_prompt, "full", store, sampling, keep_cache=True)
    publish(store, up_name, up, lm)
    head, tail = [1, 2, 3, 4, 5, 6, 7][:head_len], [9, 8, 7, 6, 5][:tail_len]  # the agent's constant template
    ids = head + up.output_ids + tail
    return CallInput(ids, [SpanRef(head_len, head_len + 24, up_name, 20, "output", "up")], name="agent")


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("qwen2")


def test_single_anchor_from_the_same_context_reproduces_full(lm):
    store = KVStore(1 << 30)
    call = _downstream(lm, store, seed=0)
    method = get_method("kvcomm[warmup=1]")
    first = generate(lm, call, method, store, ONE, keep_cache=True)
    assert first.stats.fallback is not None and "0 of 1 anchors" in first.stats.fallback
    assert len(method.pools["agent/up"].anchors) == 1
    full = generate(lm, call, "full", store, ONE, keep_cache=True)
    again = generate(lm, call, method, store, ONE, keep_cache=True)
    n = len(call.prompt_ids)
    assert again.stats.fallback is None
    assert again.stats.num_reused_tokens == n - 1  # span + template; only the last token is computed
    assert again.stats.num_computed_token_layers == lm.config.num_layers
    torch.testing.assert_close(again.cache.k[:, :, : n - 1], full.cache.k[:, :, : n - 1], atol=1e-5, rtol=0)
    torch.testing.assert_close(again.cache.v[:, :, : n - 1], full.cache.v[:, :, : n - 1], atol=1e-5, rtol=0)
    torch.testing.assert_close(again.first_logits, full.first_logits, atol=1e-4, rtol=0)


def test_tail_tokens_are_computed_and_still_reproduce_full(lm):
    """tail_tokens=5: the last 5 prompt tokens (the template tail) are computed, the rest reused exactly."""
    store = KVStore(1 << 30)
    call = _downstream(lm, store, seed=0)
    method = get_method("kvcomm[warmup=1,tail_tokens=5]")
    generate(lm, call, method, store, ONE)
    full = generate(lm, call, "full", store, ONE, keep_cache=True)
    out = generate(lm, call, method, store, ONE, keep_cache=True)
    n = len(call.prompt_ids)
    assert out.stats.fallback is None
    assert out.stats.num_reused_tokens == n - 5
    assert out.stats.num_computed_token_layers == 5 * lm.config.num_layers
    torch.testing.assert_close(out.cache.v[:, :, :n], full.cache.v[:, :, :n], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.first_logits, full.first_logits, atol=1e-4, rtol=0)
    # a tail longer than the template's: the span's last tokens are computed too
    longer = get_method("kvcomm[warmup=1,tail_tokens=9]")
    generate(lm, call, longer, store, ONE)
    assert generate(lm, call, longer, store, ONE).stats.num_reused_tokens == n - 9


def test_offsets_from_a_similar_context_bring_the_call_closer_to_full_than_naive(lm):
    """The anchor is the call with output A; the new call's output A' equals A but for its last 6 tokens. The
    18 tokens before the change see the same tokens at the same positions in both calls (attention is causal),
    so the anchor's offsets are exact for them: kvcomm gives full's V there, naive does not; over the whole
    prompt, and in the first-token distribution, kvcomm is closer to full than naive."""
    store = KVStore(1 << 30)
    method = get_method("kvcomm[warmup=1]")
    anchor_call = _downstream(lm, store, seed=0)
    assert generate(lm, anchor_call, method, store, ONE).stats.fallback is not None  # the first anchor
    up = store.get("up")
    up_prompt, output = list(up.token_ids[:20]), list(up.token_ids[20:44])
    changed = output[:18] + [(t + 17) % 256 for t in output[18:]]
    up2 = generate(lm, up_prompt, "full", store, ONE, keep_cache=True, forced_output_ids=changed)
    publish(store, "up2", up2, lm)
    ids = anchor_call.prompt_ids[:7] + changed + anchor_call.prompt_ids[31:]
    call = CallInput(ids, [SpanRef(7, 31, "up2", 20, "output", "up")], name="agent")
    out = generate(lm, call, method, store, ONE, keep_cache=True)
    naive = generate(lm, call, "naive", store, ONE, keep_cache=True)
    full = generate(lm, call, "full", store, ONE, keep_cache=True)
    assert out.stats.fallback is None and out.stats.num_reused_tokens == len(ids) - 1
    same = slice(7, 25)  # the span's first 18 tokens
    torch.testing.assert_close(out.cache.v[:, :, same], full.cache.v[:, :, same], atol=1e-4, rtol=0)
    assert (naive.cache.v[1:, :, same] - full.cache.v[1:, :, same]).abs().max() > 1e-2
    n = len(ids) - 1  # every reused row (the last one is computed by both)
    err = lambda o: float((o.cache.v[:, :, :n] - full.cache.v[:, :, :n]).norm())  # noqa: E731
    assert err(out) < 0.5 * err(naive)
    assert kl_first_token(full.first_logits, out.first_logits) < kl_first_token(full.first_logits, naive.first_logits)


def test_short_anchors_reuse_a_longer_placeholder_and_compute_the_tokens_past_them(lm):
    """The anchor holds output A (24 tokens); the new call's output is A plus 6 tokens. As published, no anchor
    is as long: fallback. With short_anchors the anchor's offsets are exact for A's tokens (same tokens, same
    context before them), the 6 tokens past it and the template tail (tail_tokens=5) are computed: the call
    matches full, and reuses exactly the head and A."""
    store = KVStore(1 << 30)
    anchor_call = _downstream(lm, store, seed=0)
    up = store.get("up")
    up_prompt, output = list(up.token_ids[:20]), list(up.token_ids[20:44])
    longer = output + [(t + 17) % 256 for t in output[:6]]
    up2 = generate(lm, up_prompt, "full", store, ONE, keep_cache=True, forced_output_ids=longer)
    publish(store, "up2", up2, lm)
    ids = anchor_call.prompt_ids[:7] + longer + anchor_call.prompt_ids[31:]
    call = CallInput(ids, [SpanRef(7, 37, "up2", 20, "output", "up")], name="agent")
    full = generate(lm, call, "full", store, ONE, keep_cache=True)
    published = get_method("kvcomm[warmup=1,tail_tokens=5]")
    generate(lm, anchor_call, published, store, ONE)
    assert "0 of 1 anchors >= 30 tokens" in generate(lm, call, published, store, ONE, learn=False).stats.fallback
    method = get_method("kvcomm[warmup=1,tail_tokens=5,short_anchors=true]")
    generate(lm, anchor_call, method, store, ONE)
    out = generate(lm, call, method, store, ONE, keep_cache=True)
    assert out.stats.fallback is None
    assert out.stats.num_reused_tokens == 7 + 24
    assert out.stats.num_computed_token_layers == (6 + 5) * lm.config.num_layers
    torch.testing.assert_close(out.cache.v[:, :, : len(ids)], full.cache.v[:, :, : len(ids)], atol=1e-4, rtol=0)
    torch.testing.assert_close(out.first_logits, full.first_logits, atol=1e-4, rtol=0)


def test_gate_fallback_is_counted_and_adds_one_anchor_per_placeholder(lm):
    store = KVStore(1 << 30)
    call = _downstream(lm, store, seed=0)
    method = get_method("kvcomm[warmup=2,gamma=1]")  # two equal anchors: entropy 1, let it pass
    outs = [generate(lm, call, method, store, ONE) for _ in range(3)]
    assert [o.stats.fallback is not None for o in outs] == [True, True, False]
    assert outs[0].stats.reuse_rate == 0.0 and outs[2].stats.reuse_rate > 0.9
    assert len(method.pools["agent/up"].anchors) == 2  # the reused call added none
    # learn=False: a fallback that does not learn leaves the pool as it was
    fresh = get_method("kvcomm[warmup=1]")
    generate(lm, call, fresh, store, ONE, learn=False)
    assert fresh.pools == {}


def test_fallback_loads_the_exact_stored_prefix_and_learns_the_same_anchor(lm):
    store = KVStore(1 << 30)
    call = _downstream(lm, store, seed=0)
    dense = get_method("kvcomm[warmup=2]")
    dense_out = generate(lm, call, dense, store, ONE)  # nothing stored starts like this prompt
    assert dense_out.stats.num_reused_tokens == 0 and dense_out.stats.fallback.endswith(
        "; dense prefill (+1 anchor per placeholder)")
    earlier = generate(lm, call.prompt_ids, "full", store, SamplingConfig(max_new_tokens=2), keep_cache=True)
    publish(store, "earlier", earlier, lm)  # a stored prefix: the whole prompt but its last token
    method = get_method("kvcomm[warmup=2]")
    out = generate(lm, call, method, store, ONE)
    assert out.stats.fallback is not None and out.stats.num_reused_tokens == len(call.prompt_ids) - 1
    # the fallback's text says what its stats count: the exact prefix reused, not a dense prefill of everything
    assert out.stats.fallback.endswith(f"; exact prefix of {len(call.prompt_ids) - 1} tokens reused, the rest a dense "
                                       "prefill (+1 anchor per placeholder)")
    torch.testing.assert_close(out.first_logits, dense_out.first_logits, atol=1e-4, rtol=0)
    (learned,), (reference,) = method.pools["agent/up"].anchors, dense.pools["agent/up"].anchors
    torch.testing.assert_close(learned.dk, reference.dk, atol=1e-4, rtol=0)
    torch.testing.assert_close(learned.dv, reference.dv, atol=1e-4, rtol=0)


def test_reset_forgets_what_kvcomm_learned(lm):
    store = KVStore(1 << 30)
    call = _downstream(lm, store, seed=0)
    method = get_method("kvcomm[warmup=1]")
    assert generate(lm, call, method, store, ONE).stats.fallback is not None  # learns the agent's first anchor
    assert generate(lm, call, method, store, ONE).stats.fallback is None
    assert method.learned_bytes > 0 and method.learned_bytes == method.budget.num_bytes
    method.reset()
    assert method.learned_bytes == 0 and method.pools == {} and method.templates == {}
    assert generate(lm, call, method, store, ONE).stats.fallback is not None  # it learns again, as at first
    assert method.learned_bytes > 0


def test_l2_gate_passes_a_nearest_anchor_and_rejects_a_tie(lm):
    """The default gate (L2 over the whole placeholder, temperature 1): two different anchors give
    near one-hot weights, so a context equal to one of them reuses; the same text anchored twice is an
    exact tie (entropy 1), which gamma 0.3 rejects."""
    store = KVStore(1 << 30)
    method = get_method("kvcomm")
    calls = [_downstream(lm, store, seed=seed, up_name=f"up{seed}", temperature=1.0) for seed in (0, 1)]
    assert calls[0].prompt_ids != calls[1].prompt_ids
    assert [generate(lm, c, method, store, ONE).stats.fallback is not None for c in calls] == [True, True]
    assert generate(lm, calls[0], method, store, ONE).stats.fallback is None
    tie = get_method("kvcomm")
    for _ in range(2):
        generate(lm, calls[0], tie, store, ONE)
    assert "entropy 1.00 > gamma 0.3" in generate(lm, calls[0], tie, store, ONE).stats.fallback


def test_l2_distances_on_a_hand_made_case():
    v = torch.ones(2, 1, 3, 4)  # [L, Hkv, n, hd]: 24 elements
    anchors = [Anchor(v.clone(), v, v), Anchor(2 * v, v, v), Anchor(torch.cat([3 * v, 9 * v], dim=2), v, v)]
    # |v - a| over the first 3 tokens: 0, sqrt(24 * 1), sqrt(24 * 4); the 4th token of the last is not compared
    torch.testing.assert_close(l2_distances(v, anchors), torch.tensor([0.0, 24 ** 0.5, 2 * 24 ** 0.5]))


def test_softmax_weights_on_a_hand_made_case():
    v = torch.ones(2, 1, 3, 4)  # [L, Hkv, n, hd]; |v| = 2 per token and layer
    same = Anchor(v.clone(), v, v)
    double = Anchor(2 * v, v, v)  # |2v - v| / |v| = 1
    longer = Anchor(torch.cat([3 * v, v], dim=2), v, v)  # first 3 tokens: |3v - v| / |v| = 2
    d = value_distances(v, [same, double, longer])
    torch.testing.assert_close(d, torch.tensor([0.0, 1.0, 2.0]))
    w = torch.softmax(-d / 0.5, dim=0)
    z = 1 + math.exp(-2) + math.exp(-4)
    torch.testing.assert_close(w, torch.tensor([1 / z, math.exp(-2) / z, math.exp(-4) / z]))
    torch.testing.assert_close(mix(w, [torch.full((2, 1, 4, 4), float(i)) for i in range(3)], 3),
                               torch.full((2, 1, 3, 4), float(w[1] + 2 * w[2])))
    # the method's weights: the same softmax, one per anchor, in the [A, 1, 1, 1] grid mix broadcasts
    torch.testing.assert_close(mixing_weights(v, [same, double, longer], 0.5).flatten(), w)
    assert normalized_entropy(torch.tensor([1.0, 0.0, 0.0])) == pytest.approx(0.0, abs=1e-9)
    assert normalized_entropy(torch.full((4,), 0.25)) == pytest.approx(1.0)
    assert normalized_entropy(torch.tensor([1.0])) == 0.0


def test_shorter_anchors_weigh_only_on_their_tokens():
    """A 4-token placeholder, anchors of 4, 2 and 1 tokens at distances 0, 1 and 2 per token (T = 1): token 0
    mixes all three, token 1 the first two (renormalized), tokens 2-3 the first alone; the mixed offsets add
    each anchor's value on its own tokens only; the gate's L2 scales a short anchor's norm to 4 tokens."""
    v = torch.ones(1, 1, 4, 4)  # [L, Hkv, n, hd]; |v| = 2 per token
    anchors = [Anchor(v.clone(), v, v), Anchor(2 * v[:, :, :2], v, v), Anchor(3 * v[:, :, :1], v, v)]
    w = mixing_weights(v, anchors, temperature=1.0)[:, 0, 0, :]  # [A, n]
    z0, z1 = 1 + math.exp(-1) + math.exp(-2), 1 + math.exp(-1)
    expected = torch.tensor([[1 / z0, 1 / z1, 1.0, 1.0], [math.exp(-1) / z0, math.exp(-1) / z1, 0, 0],
                             [math.exp(-2) / z0, 0, 0, 0]])
    torch.testing.assert_close(w, expected)
    offsets = [torch.full((1, 1, 4, 1), 1.0), torch.full((1, 1, 2, 1), 10.0), torch.full((1, 1, 1, 1), 100.0)]
    mixed = mix(mixing_weights(v, anchors, 1.0), offsets, 4).flatten()
    torch.testing.assert_close(mixed, (expected * torch.tensor([[1.0], [10.0], [100.0]])).sum(dim=0))
    # L2 over each anchor's own m tokens, scaled by sqrt(4 / m): |2v - v| = 2 per token, over 2 tokens
    # 2 sqrt(2), x sqrt(2) = 4; |3v - v| = 4 over 1 token, x 2 = 8
    torch.testing.assert_close(l2_distances(v, anchors), torch.tensor([0.0, 4.0, 8.0]))
    # a token no anchor covers has no weight at all
    short = mixing_weights(v, anchors[1:], temperature=1.0)
    torch.testing.assert_close(short[:, 0, 0, 2:], torch.zeros(2, 2))


def test_pool_evicts_the_least_used_of_the_oldest():
    def anchor(n=2):
        return Anchor(torch.zeros(1, 1, n, 1), torch.zeros(1, 1, n, 1), torch.zeros(1, 1, n, 1))

    pool = AnchorPool(max_anchors=4, evict_window=2)
    a = [anchor() for _ in range(4)]
    for x, usage in zip(a, (5.0, 1.0, 0.0, 0.0), strict=True):
        assert pool.add(x) is None
        x.usage = usage
    assert [x.anchor_id for x in pool.anchors] == [0, 1, 2, 3]
    assert pool.add(anchor()) is a[1]  # oldest two: a0 (5.0), a1 (1.0) -> a1, though a2/a3 are unused
    assert pool.add(anchor()) is a[2]  # oldest two now: a0 (5.0), a2 (0.0)
    a[0].usage = 0.0
    assert pool.add(anchor()) is a[0]  # a0 (0.0) vs a3 (0.0): tie -> the oldest
    assert [x.anchor_id for x in pool.anchors] == [3, 4, 5, 6]
    assert [x.anchor_id for x in pool.eligible(3)] == []
    pool.add(anchor(5))
    assert [x.anchor_id for x in pool.eligible(3)] == [7]


def test_bad_parameters():
    with pytest.raises(ConfigError, match="warmup"):
        get_method("kvcomm[warmup=0]")
    with pytest.raises(ConfigError, match="tail_tokens must be >= 1"):
        get_method("kvcomm[tail_tokens=0]")
    with pytest.raises(ConfigError, match="warmup <= max_anchors"):
        get_method("kvcomm[warmup=3,max_anchors=2]")
    with pytest.raises(ConfigError, match="gamma >= 0"):
        get_method("kvcomm[gamma=-0.1]")
    for internal in ("pools=1", "temperature=0.01", "mix=token", "rotate_offsets=false"):  # state, fixed internals
        with pytest.raises(ConfigError, match=f"unknown parameter '{internal.split('=')[0]}'"):
            get_method(f"kvcomm[{internal}]")


def test_a_pool_holds_at_most_max_anchors(lm):
    """max_anchors=2, below KVCOMM's eviction window of 5: the same text anchored twice is a tie the gate refuses
    (gamma 0), so every call falls back and adds an anchor; the pool evicts within the two it holds."""
    store = KVStore(1 << 30)
    call = _downstream(lm, store, seed=0)
    method = get_method("kvcomm[warmup=2,max_anchors=2,gamma=0]")
    pools = []
    for _ in range(4):
        assert generate(lm, call, method, store, ONE).stats.fallback is not None
        pools.append([a.anchor_id for a in method.pools["agent/up"].anchors])
    assert pools == [[0], [0, 1], [1, 2], [2, 3]]


def test_bench_learns_once_per_call_and_reports_fallbacks():
    """copy-agents:2 on 3 problems with warmup 2 (gate open): problems 1-2 fall back, problem 3 reuses,
    whatever the number of timed repeats of each call."""
    spec = "kvcomm[warmup=2,gamma=1]"
    bench = Bench(BenchConfig(workload="copy-agents:2", methods=(spec,), limit=3, model="random:tiny",
                              repeats=3, greedy_tokens=4))
    data = bench.run(progress=False)
    r = data["results"][spec]
    assert r["n_calls"] == 3 and r["fallback_rate"] == pytest.approx(2 / 3)
    assert r["reuse_rate_per_call"] == pytest.approx(1 / 3)
    first = next(c["fallback"] for c in data["calls"] if c["method"] == spec)
    # every placeholder the call misses on is named, not only the first
    assert first.count("has 0 of 2 anchors") == 2 and "'agent2/agent1'" in first and "'agent2/context'" in first
    method = bench.methods[spec]
    assert sorted(method.pools) == ["agent2/agent1", "agent2/context"]
    assert [len(p.anchors) for p in method.pools.values()] == [2, 2]
