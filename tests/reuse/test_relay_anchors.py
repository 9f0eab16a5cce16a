"""relay_anchors: the learning calls, a pool taught by the very call it then serves reproducing full (the moves'
layout, sign and re-rotation all checked at once), and relay's band choosing what the anchors miss. The pool itself:
test_move_pool.py."""

import pytest
import torch

from kvrelay.cache.store import KVStore
from kvrelay.errors import ConfigError
from kvrelay.eval.fidelity import kl_first_token
from kvrelay.model.sampling import SamplingConfig
from kvrelay.reuse import get_method
from kvrelay.reuse.base import CallInput, SpanRef
from tests.helpers import generate, publish, tiny_lm

ONE = SamplingConfig(max_new_tokens=1)


def test_bad_knobs_are_config_errors():
    for spec in ("relay_anchors[anchor_calls=0]", "relay_anchors[anchor_temp=0]", "relay_anchors[anchor_k=0]",
                 "relay_anchors[anchor_scale=3]", "relay_anchors[anchor_layer=-1]", "relay_anchors[anchor_dim=-1]",
                 "relay_anchors[anchor_centroids=-1]", "relay_anchors[anchor_select=-1,top_r=0.1]",
                 "relay_anchors[anchor_select=1]", "relay[selector=priors]",  # no top_r
                 "relay[selector=priors,top_r=0.1]", "relay_anchors[selector=priors,top_r=0.1]",  # no prior
                 "relay_anchors[anchor_select=1,top_r=0.1,anchor_k=1,anchor_centroids=0]",  # nothing to rank by
                 "relay_anchors[anchor_tau=1,top_r=0.1]", "relay_anchors[anchor_tau=0,anchor_select=1,top_r=0.1]"):
        with pytest.raises(ConfigError):
            get_method(spec)


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("qwen2")


def _downstream(lm, store, capture_layers: tuple[int, ...] = ()) -> CallInput:
    """An upstream call's sampled output, published (with the hidden states of ``capture_layers``), read by a
    downstream prompt in a new context."""
    up_prompt = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    up = generate(lm, up_prompt, "full", store, SamplingConfig(max_new_tokens=24, temperature=1.0, seed=0),
                  capture_layers=capture_layers, keep_cache=True)
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
    rotated for its new position (read here with ``undo_rotary``/``apply_rotary``, not the cache's ``add_keys_at``):
    the plan hands the cache the moves without RoPE, and the cache holds the loaded keys plus the rotated moves."""
    from kvrelay.cache.kv import SequenceKV
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
    patch = plan.patches[0]
    assert patch.keys_without_rope and patch.add
    torch.testing.assert_close(patch.k[1:], dk[1:])
    torch.testing.assert_close(patch.v[1:], dv[1:])
    assert not patch.k[0].any()  # layer 0 untouched
    cache = SequenceKV(lm.config, torch.float32, "cpu")
    cache.load_span(span, 10, rope, 20, 44)
    loaded_k, loaded_v = cache.k[:, :, 10:34].clone(), cache.v[:, :, 10:34].clone()
    cache.patch(patch.dst_start, patch.k, patch.v, patch.add, rope)
    cos, sin = rope.cos_sin(torch.arange(10, 34), torch.float32)
    torch.testing.assert_close(cache.k[:, :, 10:34], loaded_k + apply_rotary(patch.k, cos, sin), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.v[:, :, 10:34], loaded_v + patch.v)


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


@pytest.mark.parametrize("start", [0, 1])  # 0: every span token enters and is selected at layer 0; 1: admitted
def test_anchor_select_recomputes_the_tokens_the_anchors_expect_to_miss_most(lm, monkeypatch, start):
    """With ``selector=priors`` and ``anchor_select``, relay's budget form ranks the span tokens by the residual the
    pool expects (``estimate_with_residual``, by prompt position) alone: the band keeps exactly the top_r of them,
    chosen where they enter (l_start = l_det = 1: admitted from their carried states before any is computed) or at
    layer 0."""
    import kvrelay.reuse.relay as relay_module

    store = KVStore(1 << 30)
    call = _downstream(lm, store, capture_layers=(start,) if start else ())
    n = lm.config.num_layers
    method = get_method(f"relay_anchors[anchor_calls=1,anchor_k=3,anchor_temp=0.5,l_start={start},l_det={start},"
                        f"l_end={n - 1},top_r=0.25,l_pre=0,l_suf=0,selector=priors,anchor_select=1]")
    generate(lm, call, method, store, ONE)  # teaches the pool
    chosen = []
    select_top = relay_module.select_top

    def spy(deviation, influence, *args, **kwargs):
        assert deviation is None and influence is None  # the priors alone rank
        keep = select_top(deviation, influence, *args, **kwargs)
        chosen.append(keep)
        return keep

    monkeypatch.setattr(relay_module, "select_top", spy)
    out = generate(lm, call, method, store, ONE)
    assert out.stats.fallback is None and out.stats.note is None and len(chosen) == 1  # (no span recomputed whole)
    # the 12 new tokens run every layer; the 6 kept span tokens run layers 1 up; at start 0 all 24 span tokens also
    # get their K/V at layer 0, where the selection reads them (admitted at 1, the 18 refused are never computed)
    assert out.stats.num_computed_token_layers == 12 * n + 6 * (n - 1) + (24 if start == 0 else 0)
    span, rope = store.get("p/up"), lm.model.rope
    from kvrelay.model.rope import undo_rotary

    cos, sin = rope.cos_sin(torch.arange(span.start_pos + 20, span.start_pos + 44), torch.float32)
    keys_free = undo_rotary(span.k[method.pool.match_layer, :, 20:44].float(), cos, sin)
    residual = method.pool.estimate_with_residual("agent/up", keys_free, n)[2]  # [24], prompt positions 7..30
    assert residual.unique().numel() > 12  # a ranking, not ties
    kept = chosen[0].nonzero().squeeze(1)  # rows of the span tokens, in prompt order
    assert kept.tolist() == sorted(residual.topk(6).indices.tolist())


@pytest.mark.parametrize("quantile", [0.1, 0.5, 0.8])
def test_anchor_tau_recomputes_the_tokens_expected_to_miss_more_than_it(lm, monkeypatch, quantile):
    """With ``anchor_tau`` the band's size is the call's count of span tokens whose expected miss passes it (top_r is
    replaced), ranked as before: they are exactly the ones recomputed."""
    import kvrelay.reuse.relay as relay_module
    from kvrelay.model.rope import undo_rotary

    store = KVStore(1 << 30)
    call = _downstream(lm, store, capture_layers=(1,))
    n = lm.config.num_layers
    band = f"l_start=1,l_det=1,l_end={n - 1},top_r=0.25,l_pre=0,l_suf=0,selector=priors,anchor_select=1"
    teacher = get_method(f"relay_anchors[anchor_calls=1,anchor_k=3,anchor_temp=0.5,{band}]")
    generate(lm, call, teacher, store, ONE)  # teaches the pool
    span, rope = store.get("p/up"), lm.model.rope
    cos, sin = rope.cos_sin(torch.arange(span.start_pos + 20, span.start_pos + 44), torch.float32)
    keys_free = undo_rotary(span.k[teacher.pool.match_layer, :, 20:44].float(), cos, sin)
    residual = teacher.pool.estimate_with_residual("agent/up", keys_free, n)[2]  # [24], prompt positions 7..30
    tau = float(residual.quantile(quantile))
    num_over = int((residual > tau).sum())
    assert 0 < num_over < 24 and num_over != 6  # not top_r's 6
    method = get_method(f"relay_anchors[anchor_calls=1,anchor_k=3,anchor_temp=0.5,{band},anchor_tau={tau!r}]")
    method.pool = teacher.pool
    chosen = []
    select_top = relay_module.select_top

    def spy(*args, **kwargs):
        chosen.append(select_top(*args, **kwargs))
        return chosen[-1]

    monkeypatch.setattr(relay_module, "select_top", spy)
    out = generate(lm, call, method, store, ONE)
    over = (residual > tau).nonzero().squeeze(1)  # rows of the span tokens, in prompt order
    assert len(chosen) == 1 and chosen[0].nonzero().squeeze(1).tolist() == over.tolist()
    assert out.stats.num_computed_token_layers == 12 * n + num_over * (n - 1)


def test_anchor_tau_counts_only_the_tokens_not_kept_anyway(lm, monkeypatch):
    """The span's last ``l_suf`` tokens are kept whatever their score: the threshold counts the others only."""
    import kvrelay.reuse.relay as relay_module
    from kvrelay.model.rope import undo_rotary

    store = KVStore(1 << 30)
    call = _downstream(lm, store, capture_layers=(1,))
    n = lm.config.num_layers
    band = f"l_start=1,l_det=1,l_end={n - 1},top_r=0.25,l_pre=0,l_suf=4,selector=priors,anchor_select=1"
    teacher = get_method(f"relay_anchors[anchor_calls=1,anchor_k=3,anchor_temp=0.5,{band}]")
    generate(lm, call, teacher, store, ONE)
    span, rope = store.get("p/up"), lm.model.rope
    cos, sin = rope.cos_sin(torch.arange(span.start_pos + 20, span.start_pos + 44), torch.float32)
    keys_free = undo_rotary(span.k[teacher.pool.match_layer, :, 20:44].float(), cos, sin)
    residual = teacher.pool.estimate_with_residual("agent/up", keys_free, n)[2]  # [24]
    tau = float(residual[:20].quantile(0.5))  # over the 20 not kept anyway: 10 above
    assert int((residual[20:] > tau).sum()) > 0  # the kept ones would add to a count over all 24
    method = get_method(f"relay_anchors[anchor_calls=1,anchor_k=3,anchor_temp=0.5,{band},anchor_tau={tau!r}]")
    method.pool = teacher.pool
    budgets = []
    select_top = relay_module.select_top

    def spy(deviation, influence, always_mask, top_r, priors=()):
        budgets.append(round(top_r * always_mask.numel()))
        return select_top(deviation, influence, always_mask, top_r, priors)

    monkeypatch.setattr(relay_module, "select_top", spy)
    generate(lm, call, method, store, ONE)
    assert budgets == [int((residual[:20] > tau).sum())] == [10]


def test_a_scaled_estimate_expects_to_miss_what_the_scale_leaves_out(lm, monkeypatch):
    """With anchor_scale s the patch adds s x the estimate, so each token's prior is the pool's expected residual plus
    (1 - s)^2 x |estimate|^2."""
    import kvrelay.reuse.relay as relay_module

    store = KVStore(1 << 30)
    call = _downstream(lm, store)
    n = lm.config.num_layers
    method = get_method(f"relay_anchors[anchor_calls=1,anchor_k=3,anchor_temp=0.5,anchor_scale=0.5,l_start=0,l_det=0,"
                        f"l_end={n - 1},top_r=0.25,l_pre=0,l_suf=0,selector=priors,anchor_select=1]")
    generate(lm, call, method, store, ONE)
    seen = []
    select_top = relay_module.select_top

    def spy(deviation, influence, always_mask, top_r, priors=()):
        seen.append([score for score, _ in priors])
        return select_top(deviation, influence, always_mask, top_r, priors)

    monkeypatch.setattr(relay_module, "select_top", spy)
    generate(lm, call, method, store, ONE)
    span, rope = store.get("p/up"), lm.model.rope
    from kvrelay.model.rope import undo_rotary

    cos, sin = rope.cos_sin(torch.arange(span.start_pos + 20, span.start_pos + 44), torch.float32)
    keys_free = undo_rotary(span.k[method.pool.match_layer, :, 20:44].float(), cos, sin)
    k_move, v_move, residual = method.pool.estimate_with_residual("agent/up", keys_free, n)
    expected = residual + 0.25 * (k_move.pow(2).sum((0, 1, 3)) + v_move.pow(2).sum((0, 1, 3)))
    assert len(seen) == 1 and len(seen[0]) == 1
    torch.testing.assert_close(seen[0][0], expected, rtol=1e-5, atol=1e-6)
    # the patch adds half the estimate, with the prior read (here) and without (naive plus anchors)
    naive_anchors = get_method(f"relay_anchors[anchor_calls=1,anchor_k=3,anchor_temp=0.5,anchor_scale=0.5,"
                               f"l_start={n},l_det={n},l_end={n}]")
    naive_anchors.pool = method.pool
    for plan in (method.plan(call, store, lm), naive_anchors.plan(call, store, lm)):
        assert len(plan.patches) == 1 and plan.patches[0].keys_without_rope
        torch.testing.assert_close(plan.patches[0].k[1:], 0.5 * k_move[1:])
        torch.testing.assert_close(plan.patches[0].v[1:], 0.5 * v_move[1:])
