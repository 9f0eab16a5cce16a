"""relay_anchors' spans prepared at publish (``anchor_prep``): the anchored span itself, which roles get one, the
bound, and a call on a prepared span matching the same call with its anchors computed on the call."""

import pytest
import torch

from kvrelay.cache.kv import StoredSpan
from kvrelay.cache.store import KVStore
from kvrelay.cache.tenancy import scoped_key
from kvrelay.engine import Engine
from kvrelay.errors import ConfigError
from kvrelay.model.rope import apply_rotary
from kvrelay.model.sampling import SamplingConfig
from kvrelay.reuse import get_method
from kvrelay.reuse.anchor_prep import MAX_OPENING_TOKENS, MIN_OPENING_TOKENS, PreparedSpans, anchored_span
from kvrelay.reuse.base import CallInput, SpanRef
from tests.helpers import generate, publish, tiny_lm

ONE = SamplingConfig(max_new_tokens=1)


def _upstream(lm, store, seed: int = 0):
    """An upstream call's sampled output, published as "p/up" (layer 1 carried: a band may enter there), and a
    downstream call reading it in a new context."""
    up_prompt = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(seed)).tolist()
    up = generate(lm, up_prompt, "full", store, SamplingConfig(max_new_tokens=24, temperature=1.0, seed=seed),
                  capture_layers=(1,), keep_cache=True)
    publish(store, "p/up", up, lm)
    call = CallInput([1, 2, 3, 4, 5, 6, 7] + up.output_ids + [9, 8, 7, 6, 5],
                     [SpanRef(7, 31, "p/up", 20, "output", "up")], name="agent")
    return up, call


def test_anchored_span_adds_the_key_moves_rotated_for_the_spans_own_positions():
    lm = tiny_lm("gemma3")  # per-layer RoPE bases
    cfg = lm.config
    gen = torch.Generator().manual_seed(0)
    shape = (cfg.num_layers, cfg.num_kv_heads, 6, cfg.head_dim)
    k, v, dk, dv = (torch.randn(shape, generator=gen) for _ in range(4))
    span = StoredSpan(tuple(range(6)), 5, k, v, lm.fingerprint, {1: torch.zeros(6, cfg.hidden_size)})
    out = anchored_span(span, dk, dv, lm.model.rope)
    rope = lm.model.rope
    for layer in (0, 1):  # a local and a global layer
        r = rope.local if rope.local is not None and cfg.is_local(layer) else rope
        cos, sin = r.cos_sin(torch.arange(5, 11), torch.float32)
        torch.testing.assert_close(out.k[layer], k[layer] + apply_rotary(dk[layer], cos, sin), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.v, v + dv)
    assert out.start_pos == 5 and out.hidden is span.hidden and torch.equal(span.k, k)  # the source untouched


def _span(opening: list[int], rest: int) -> StoredSpan:
    ids = tuple(opening + [rest] * 5)
    kv = torch.zeros(1, 1, len(ids), 2)
    return StoredSpan(ids, 0, kv, kv, "f")


def test_a_role_reads_the_kinds_of_span_whose_openings_it_saw():
    """A kind is the opening its spans share (at least MIN_OPENING_TOKENS tokens): spans of one publisher, whatever
    their question, are one kind; spans whose openings part sooner are another."""
    solver = list(range(10, 10 + MIN_OPENING_TOKENS + 4))
    critic = list(range(10, 10 + MIN_OPENING_TOKENS - 1)) + [99] * 5
    prepared = PreparedSpans(2)
    prepared.note_read("critic/answer", _span(solver, 1))
    prepared.note_read("critic/answer", _span(solver, 2))  # another question: the same kind, its opening cut
    prepared.note_read("final/critique", _span(critic, 1))
    assert prepared.roles_reading(_span(critic, 3)) == []  # one span read: all of its opening is the kind's
    prepared.note_read("final/critique", _span(critic, 2))
    assert prepared._read_by["critic/answer"] == [tuple(solver)]
    assert prepared.roles_reading(_span(solver, 3)) == ["critic/answer"]  # by opening, not by object
    assert prepared.roles_reading(_span(critic, 3)) == ["final/critique"]  # parts from the solver's too soon
    assert prepared.roles_reading(_span(list(range(50, 60)), 1)) == []
    prepared.note_read("critic/answer", _span(critic, 1))
    assert len(prepared._read_by["critic/answer"]) == 2  # a second kind, not the first one cut short
    long = _span(list(range(MAX_OPENING_TOKENS + 10)), 1)
    prepared.note_read("x", long)
    assert prepared.roles_reading(long) == ["x"] and len(prepared._read_by["x"][0]) == MAX_OPENING_TOKENS


def test_the_prepared_set_is_bounded():
    a, b = _span(list(range(MIN_OPENING_TOKENS)), 1), _span(list(range(MIN_OPENING_TOKENS)), 2)
    prepared = PreparedSpans(2)
    for i in range(3):
        prepared.put(f"s{i}", "critic/answer", object.__new__(type("P", (), {"source": a})))
    assert len(prepared) == 2 and prepared.get("s0", "critic/answer", a) is None  # the oldest dropped
    assert prepared.get("s2", "critic/answer", a) is not None
    assert prepared.get("s2", "critic/answer", b) is None  # made from another span published under that id
    none = PreparedSpans(0)
    none.put("s0", "critic/answer", object())
    assert len(none) == 0
    with pytest.raises(ConfigError):
        get_method("relay_anchors[anchor_prepare=-1]")


def test_each_namespace_has_its_own_bound():
    """One tenant publishing many spans never drops another's prepared spans: whether a call finds its span prepared
    (and so its exact K/V, rounded once at publish) depends on its own tenant alone."""
    a = _span(list(range(MIN_OPENING_TOKENS)), 1)
    prepared = PreparedSpans(2)
    b_role = scoped_key("kB", "critic/answer")
    prepared.put("b0", b_role, object.__new__(type("P", (), {"source": a})))
    for i in range(5):
        prepared.put(f"a{i}", scoped_key("kA", "critic/answer"), object.__new__(type("P", (), {"source": a})))
    assert prepared.get("b0", b_role, a) is not None
    assert prepared.get("a4", b_role, a) is None and len(prepared) == 3


# naive plus anchors; the 25% band they expect to miss most; that band on anchors blended with the ridge readout
@pytest.mark.parametrize(("band", "blend"), [(False, 0.0), (True, 0.0), (True, 0.5)])
def test_a_prepared_span_gives_the_call_its_anchors_without_computing_them(band, blend):
    """A span published (through an engine that holds the method) after its reading role is done learning is
    prepared for that role. The call then loads it under a derived id with no patch, and its cache, recompute and
    first-token logits equal those of the same call whose span was published again without the method (so its
    anchors are computed on the call)."""
    lm = tiny_lm("qwen2")
    store = KVStore(1 << 30)
    up, call = _upstream(lm, store)
    n = lm.config.num_layers
    knobs = "l_start=1,l_det=1,l_end=2,top_r=0.25,l_pre=0,l_suf=0,selector=priors,anchor_select=1" if band else \
        f"l_start={n},l_det={n},l_end={n}"
    method = get_method(f"relay_anchors[anchor_calls=1,anchor_k=2,anchor_centroids=8,anchor_blend={blend},{knobs}]")
    generate(lm, call, method, store, ONE)  # teaches and freezes agent/up
    assert len(method.prepared) == 0
    Engine(lm, store, [method]).publish("p/up", up)
    assert len(method.prepared) == 1
    logged = method.settings(lm)["prepared_at_publish"]
    assert (logged["num_spans"], logged["num_role_tokens"]) == (1, len(up.prompt_ids) + len(up.output_ids))
    estimate = method.pool.estimate_moves
    method.pool.estimate_moves = None  # a prepared call computes no anchors: calling it would raise
    plan = method.plan(call, store, lm)
    method.pool.estimate_moves = estimate
    assert not plan.patches and [load.span_id for load in plan.loads] == ["p/up@anchors:agent/up"]
    prepared = generate(lm, call, method, store, ONE, keep_cache=True)
    publish(store, "p/up", up, lm)  # the same KV, a new span object: the prepared one is not used
    assert len(method.plan(call, store, lm).patches) == 1
    on_call = generate(lm, call, method, store, ONE, keep_cache=True)
    logged = method.settings(lm)["prepared_at_publish"]
    assert (logged["num_loads_prepared"], logged["num_loads_on_call"]) == (2, 2)  # plan + call each way
    assert prepared.stats.fallback is None and on_call.stats.fallback is None
    assert prepared.stats.num_computed_token_layers == on_call.stats.num_computed_token_layers
    if band:
        assert prepared.stats.num_computed_token_layers > generate(lm, call, "naive", store, ONE).stats \
            .num_computed_token_layers
    rows = slice(0, len(call.prompt_ids))  # the prompt's (the cache's rows past it are not written)
    torch.testing.assert_close(prepared.cache.k[:, :, rows], on_call.cache.k[:, :, rows], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(prepared.cache.v[:, :, rows], on_call.cache.v[:, :, rows], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(prepared.first_logits, on_call.first_logits, atol=1e-4, rtol=1e-4)
    naive = generate(lm, call, "naive", store, ONE, keep_cache=True)
    assert not torch.allclose(prepared.cache.v[:, :, rows], naive.cache.v[:, :, rows], atol=1e-3)  # anchors added


def test_only_spans_of_a_kind_the_role_read_are_prepared():
    lm = tiny_lm("qwen2")
    store = KVStore(1 << 30)
    up, call = _upstream(lm, store)
    n = lm.config.num_layers
    method = get_method(f"relay_anchors[anchor_calls=2,l_start={n},l_det={n},l_end={n}]")
    engine = Engine(lm, store, [method])
    generate(lm, call, method, store, ONE)
    engine.publish("p/up", up)
    assert len(method.prepared) == 0  # the role is still learning
    generate(lm, call, method, store, ONE)
    other, _ = _upstream(lm, KVStore(1 << 30), seed=1)  # another opening: a kind of span the role never read
    engine.publish("p/other", other)
    assert len(method.prepared) == 0
    engine.publish("p/up", up)
    assert len(method.prepared) == 1


def test_a_method_that_fails_to_prepare_leaves_the_span_published(caplog):
    """``on_publish`` raising is logged and counted; the span is stored all the same and the engine keeps working."""
    lm = tiny_lm("qwen2")
    store = KVStore(1 << 30)
    up, call = _upstream(lm, store)
    n = lm.config.num_layers
    method = get_method(f"relay_anchors[anchor_calls=1,anchor_k=2,anchor_centroids=8,l_start={n},l_det={n},l_end={n}]")
    generate(lm, call, method, store, ONE)

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    method.pool.estimate_moves = broken
    engine = Engine(lm, store, [method])
    span = engine.publish("p/again", up)
    assert store.get("p/again") is span and engine.num_publish_errors == 1
    assert "could not prepare span 'p/again'" in caplog.text and "out of memory" in caplog.text
