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


def test_freeze_keeps_the_index_and_frees_the_tokens():
    pool = MovePool(match_layer=1, max_tokens=100, top_k=2, temperature=0.1, dim=3, num_centroids=4)
    feat, dk, dv = _moves(9, 0)
    pool.add("r", feat, dk, dv)
    before = pool.estimate("r", feat, L)
    pool.freeze("r")
    assert pool.num_tokens("r") == 0 and pool.num_entries("r") == 4
    role = pool._roles["r"]
    assert role.feat.untyped_storage().nbytes() == 0 and role.moves.untyped_storage().nbytes() == 0  # freed
    # 4 rows of 3-dim float32 keys and fp16 moves, the mean and the basis (float32)
    assert pool.nbytes == 4 * (3 * 4 + 2 * L * HKV * HD * 2) + (HKV * HD) * 4 + (HKV * HD) * 3 * 4
    for a, b in zip(pool.estimate("r", feat, L), before, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="frozen"):
        pool.add("r", feat, dk, dv)


def test_bad_knobs_are_config_errors():
    for spec in ("relay_anchors[anchor_calls=0]", "relay_anchors[anchor_temp=0]", "relay_anchors[anchor_k=0]",
                 "relay_anchors[anchor_scale=3]", "relay_anchors[anchor_layer=-1]", "relay_anchors[anchor_dim=-1]",
                 "relay_anchors[anchor_centroids=-1]"):
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
@pytest.mark.parametrize("dim", [0, 6])  # the features themselves, or projected on 6 principal directions
def test_learning_calls_then_anchors_reproduce_full(family, dim):
    """With top_k=1 and a pool taught by this very call, every span token gets its own true move: naive plus
    anchors (the empty band) must then equal full, while naive alone does not."""
    lm = tiny_lm(family)
    store = KVStore(1 << 30)
    call = _downstream(lm, store)
    num_layers = lm.config.num_layers
    method = get_method(f"relay_anchors[anchor_calls=2,anchor_k=1,anchor_dim={dim},l_start={num_layers},"
                        f"l_det={num_layers},l_end={num_layers}]")
    for i in range(2):
        taught = generate(lm, call, method, store, ONE)
        assert taught.stats.fallback is not None and f"{i} of its 2 dense calls" in taught.stats.fallback
    assert method.pool.num_calls("agent/up") == 2
    assert method.pool.num_tokens("agent/up") == 0 and method.pool.num_entries("agent/up") == 48  # frozen
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


def test_a_learning_call_leaves_a_role_that_is_done_learning_as_it_is(lm):
    """A call that reads a finished role's span and a new role's runs dense for the new role: it teaches that one
    and leaves the finished (frozen) one untouched."""
    store = KVStore(1 << 30)
    call = _downstream(lm, store)
    method = get_method("relay_anchors[anchor_calls=1,l_start=0,l_det=1,l_end=2]")
    generate(lm, call, method, store, ONE)
    entries = method.pool.num_entries("agent/up")
    span_ids = call.prompt_ids[7:31]
    both = CallInput(call.prompt_ids[:31] + [3, 3] + span_ids + call.prompt_ids[31:],
                     [call.refs[0], SpanRef(33, 57, "p/up", 20, "output", "again")], name="agent")
    out = generate(lm, both, method, store, ONE)
    assert out.stats.fallback is not None and "agent/again" in out.stats.fallback
    assert method.pool.num_calls("agent/again") == 1 and method.pool.num_calls("agent/up") == 1
    assert method.pool.num_entries("agent/up") == entries


def test_a_role_done_learning_is_served_from_its_clusters(lm):
    """Through the method: the last learning call freezes the role into ``anchor_centroids`` clusters, and a served
    call's patch is the mean move of the cluster each token falls in (anchor_k=1)."""
    store = KVStore(1 << 30)
    call = _downstream(lm, store)
    n = lm.config.num_layers
    method = get_method(f"relay_anchors[anchor_calls=1,anchor_k=1,anchor_centroids=8,l_start={n},l_det={n},l_end={n}]")
    generate(lm, call, method, store, ONE)
    pool = method.pool
    assert pool.num_tokens("agent/up") == 0 and pool.num_entries("agent/up") == 8
    plan = method.plan(call, store, lm)
    assert plan.fallback is None and len(plan.patches) == 1
    index = pool.index("agent/up")
    span, rope = store.get("p/up"), lm.model.rope
    cos, sin = rope.cos_sin(torch.arange(span.start_pos + 20, span.start_pos + 44), torch.float32)
    from kvrelay.model.rope import undo_rotary

    keys_free = undo_rotary(span.k[pool.match_layer, :, 20:44].float(), cos, sin)
    nearest = (index.match(pool.features(keys_free)) @ index.keys.T).argmax(-1)  # [24]
    v_rows = index.moves.float().view(8, 2 * n, -1)[:, n:]  # [8, L, Hkv * hd]: each cluster's V moves
    expected_v = v_rows[nearest].view(24, n, lm.config.num_kv_heads, -1).permute(1, 2, 0, 3)  # -> [L, Hkv, 24, hd]
    torch.testing.assert_close(plan.patches[0].v[1:], expected_v[1:], atol=1e-3, rtol=0)
