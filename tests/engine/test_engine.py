"""generate(): reuse through the store, publishing, stop tokens, sampling, stats."""

import pytest
import torch

from kvrelay.cache.store import KVStore
from kvrelay.engine import CallStats
from kvrelay.errors import ConfigError
from kvrelay.eval.fidelity import kl_first_token
from kvrelay.model.sampling import Sampler, SamplingConfig
from tests.helpers import generate, publish, tiny_lm


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("llama3")


def _prompt(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_published_span_holds_prompt_and_every_output_token(lm):
    store = KVStore(1 << 30)
    prompt = _prompt(20, 0)
    out = generate(lm, prompt, "full", store, SamplingConfig(max_new_tokens=7), keep_cache=True)
    publish(store, "a", out, lm)
    span = store.get("a")
    assert out.stop_reason == "length" and len(out.output_ids) == 7
    assert span.token_ids == tuple(prompt + out.output_ids)
    assert span.k.shape[2] == 27 and span.start_pos == 0
    assert span.nbytes == 2 * 4 * 2 * 27 * 16 * 4  # K and V: layers x kv_heads x tokens x head_dim x fp32


def test_prefix_reuse_reproduces_full_on_a_downstream_call(lm):
    store = KVStore(1 << 30)
    upstream = generate(lm, _prompt(24, 1), "full", store, SamplingConfig(max_new_tokens=10), keep_cache=True)
    publish(store, "up", upstream, lm)
    downstream = upstream.prompt_ids + upstream.output_ids + _prompt(9, 2)
    full = generate(lm, downstream, "full", store, SamplingConfig(max_new_tokens=12))
    pre = generate(lm, downstream, "prefix", store, SamplingConfig(max_new_tokens=12))
    assert pre.stats.num_reused_tokens == 34
    torch.testing.assert_close(pre.first_logits, full.first_logits, atol=1e-4, rtol=0)
    assert pre.output_ids == full.output_ids
    assert kl_first_token(full.first_logits, pre.first_logits) < 1e-8
    layers = lm.config.num_layers
    assert pre.stats.num_computed_token_layers == 9 * layers
    assert pre.stats.reuse_rate == pytest.approx(34 / 43)
    assert pre.stats.recompute_frac == 0.0


def test_prefix_recomputes_the_last_token_of_a_fully_cached_prompt(lm):
    store = KVStore(1 << 30)
    prompt = _prompt(16, 3)
    publish(store, "p", generate(lm, prompt, "full", store, SamplingConfig(max_new_tokens=3), keep_cache=True), lm)
    full = generate(lm, prompt, "full", store, SamplingConfig(max_new_tokens=1))
    pre = generate(lm, prompt, "prefix", store, SamplingConfig(max_new_tokens=1))
    assert pre.stats.num_reused_tokens == 15
    torch.testing.assert_close(pre.first_logits, full.first_logits, atol=1e-4, rtol=0)


def test_prefix_ignores_spans_of_another_model(lm):
    other = tiny_lm("llama3", seed=1)
    store = KVStore(1 << 30)
    prompt = _prompt(40, 4)
    publish(store, "x", generate(other, prompt, "full", store, SamplingConfig(max_new_tokens=2), keep_cache=True),
            other)
    assert generate(lm, prompt, "prefix", store, SamplingConfig(max_new_tokens=1)).stats.num_reused_tokens == 0


def test_stop_token_ends_generation(lm, monkeypatch):
    prompt = _prompt(10, 5)
    first = generate(lm, prompt, "full", sampling=SamplingConfig(max_new_tokens=16))
    ids = first.output_ids
    cut = max(i for i, t in enumerate(ids) if t not in ids[:i])  # the last token seen for the first time
    monkeypatch.setattr(lm.tokenizer, "stop_ids", frozenset({ids[cut]}))
    out = generate(lm, prompt, "full", sampling=SamplingConfig(max_new_tokens=16))
    assert out.stop_reason == "stop" and out.output_ids == ids[:cut]


def test_decode_hidden_states_are_captured(lm):
    store = KVStore(1 << 30)
    out = generate(lm, _prompt(10, 6), "full", store, SamplingConfig(max_new_tokens=4), capture_layers=(1, 3),
                   keep_cache=True)
    assert sorted(out.decode_hidden) == [1, 3]
    assert out.decode_hidden[1].shape == (4, lm.config.hidden_size)  # every output token, incl. the last
    span = publish(store, "h", out, lm)
    assert span.hidden_from == 0 and span.hidden[3].shape == (14, lm.config.hidden_size)
    # the prompt rows are the prefill's layer inputs, the rest the decode's
    torch.testing.assert_close(span.hidden_rows(1, 10, 14), out.decode_hidden[1])


def test_forced_output_kv_equals_decoding_it(lm):
    prompt = _prompt(12, 11)
    decoded = generate(lm, prompt, "full", sampling=SamplingConfig(max_new_tokens=6), capture_layers=(2,),
                       keep_cache=True)
    forced = generate(lm, prompt, "full", capture_layers=(2,), keep_cache=True,
                      forced_output_ids=decoded.output_ids)
    assert forced.output_ids == decoded.output_ids and forced.stop_reason == "forced"
    n = 18
    torch.testing.assert_close(forced.cache.k[:, :, :n], decoded.cache.k[:, :, :n], atol=1e-5, rtol=0)
    torch.testing.assert_close(forced.decode_hidden[2], decoded.decode_hidden[2], atol=1e-5, rtol=0)


def test_sampling_is_seeded_and_top_p_keeps_the_top_token():
    logits = torch.tensor([5.0, 4.0, 0.0, -1.0])
    a = [Sampler(SamplingConfig(temperature=1.0, seed=3))(logits) for _ in range(5)]
    b = [Sampler(SamplingConfig(temperature=1.0, seed=3))(logits) for _ in range(5)]
    assert a == b
    tiny_p = Sampler(SamplingConfig(temperature=1.0, top_p=0.01, seed=0))
    assert {tiny_p(logits) for _ in range(20)} == {0}
    nucleus = Sampler(SamplingConfig(temperature=1.0, top_p=0.9, seed=0))
    assert {nucleus(logits) for _ in range(200)} == {0, 1}  # p(0)+p(1) > 0.9 covers the rest out


def test_sampling_config_validation():
    with pytest.raises(ConfigError, match="top_p"):
        SamplingConfig(top_p=0)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        SamplingConfig(max_new_tokens=0)


def test_call_stats_definitions():
    s = CallStats("m", num_prompt_tokens=10, num_layers=4, num_reused_tokens=6, num_computed_token_layers=4 * 4 + 3,
                  num_shifted_tokens=0, ttft_ms=1.0)
    assert s.reuse_rate == pytest.approx(1 - 19 / 40)
    assert s.recompute_frac == pytest.approx(3 / 24)  # 4 new tokens at 4 layers; 3 reused token-layers redone


def test_moving_keys_under_dynamic_rope_falls_back_to_full_and_says_so():
    import dataclasses

    from kvrelay.model.schedule import SuffixSchedule
    from kvrelay.reuse.base import Plan, ReuseMethod, SpanLoad

    lm = tiny_lm("llama2")
    cfg = dataclasses.replace(lm.config, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    lm.model.config = lm.config = cfg
    lm.model._rope = None
    store = KVStore(1 << 30)
    up = generate(lm, _prompt(12, 8), "full", store, SamplingConfig(max_new_tokens=2), keep_cache=True)
    publish(store, "up", up, lm)

    class MoveSpan(ReuseMethod):  # reuse the upstream prompt 5 positions later
        name = "move"

        def plan(self, call, store, lm):
            return Plan(SuffixSchedule(17), [SpanLoad("up", 0, 12, 5)])

    prompt = _prompt(5, 9) + up.prompt_ids + _prompt(4, 10)
    out = generate(lm, prompt, MoveSpan(), store, SamplingConfig(max_new_tokens=1))
    full = generate(lm, prompt, "full", store, SamplingConfig(max_new_tokens=1))
    assert "cannot move keys" in out.stats.fallback
    assert out.stats.num_reused_tokens == 0 and out.stats.reuse_rate == 0.0
    torch.testing.assert_close(out.first_logits, full.first_logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["llama3", "gemma3"])
def test_a_stored_prefix_gives_full_logits_in_prefill_and_decode(family):
    """The prefix loaded from the store (into a pooled buffer when one is idle); gemma3's 8-token window
    leaves new rows that see none of it."""
    model = tiny_lm(family)
    store = KVStore(1 << 30)
    upstream = generate(model, _prompt(30, 4), "full", store, SamplingConfig(max_new_tokens=6), keep_cache=True)
    publish(store, "up", upstream, model)
    downstream = upstream.prompt_ids + upstream.output_ids + _prompt(12, 5)
    full = generate(model, downstream, "full", store, SamplingConfig(max_new_tokens=10))
    for method in ("prefix", "naive"):
        out = generate(model, downstream, method, store, SamplingConfig(max_new_tokens=10))
        assert out.stats.num_reused_tokens == 36
        torch.testing.assert_close(out.first_logits, full.first_logits, atol=1e-4, rtol=0)
        assert out.output_ids == full.output_ids


@pytest.mark.parametrize("method", ["prefix", "naive", "epic", "cacheblend",
                                    "relay[band=1:1:2,keep_share=0.5,span_openings=2,prune_share=0.2]",
                                    "relay[band=1:1:2,keep_share=0.5,span_openings=2,prune_share=0.2,drift=0.5]"])
def test_spans_read_in_place_give_what_copied_spans_give(lm, method, monkeypatch):
    """Loads read in place (``cache.refs``) against the same loads copied, through plan, prefill (relay's and
    epic's writes over reused rows included) and decode: same tokens, same counts, logits within float noise."""
    from kvrelay.cache import kv
    from kvrelay.reuse.base import CallInput, SpanRef

    store = KVStore(1 << 30)
    upstream = generate(lm, _prompt(24, 1), "full", store, SamplingConfig(max_new_tokens=10), keep_cache=True,
                        capture_layers=(1,))
    publish(store, "up", upstream, lm)
    # the upstream prompt as an exact prefix, then its output moved 3 positions later, then new tokens
    ids = upstream.prompt_ids + _prompt(3, 6) + upstream.output_ids + _prompt(12, 5)
    call = CallInput(ids, refs=[SpanRef(27, 37, "up", 24)])
    outs = {}
    for rule in (10**9, 1):  # every load copied; every load read in place
        monkeypatch.setattr(kv, "IN_PLACE_MIN_TOKENS", rule)
        outs[rule] = generate(lm, call, method, store, SamplingConfig(max_new_tokens=8), capture_layers=(1,),
                              keep_cache=True)
    copied, in_place = outs[10**9], outs[1]
    assert in_place.cache._refs and not copied.cache._refs  # the two paths really differ
    assert all(r.span is None for r in in_place.cache._refs)  # decoding copied them in: the spans are let go
    assert in_place.stats.num_reused_tokens == copied.stats.num_reused_tokens >= 10
    assert in_place.stats.num_computed_token_layers == copied.stats.num_computed_token_layers
    torch.testing.assert_close(in_place.first_logits, copied.first_logits, atol=1e-4, rtol=0)
    assert in_place.output_ids == copied.output_ids


def test_one_method_spec_given_alone_is_that_method(lm):
    """``Engine(lm, store, methods="epic")`` sets up epic, not one method per character of the string."""
    from kvrelay.engine import Engine, GenerateOptions

    engine = Engine(lm, KVStore(budget_bytes=1 << 24), methods="epic")
    out = engine.generate(_prompt(8, 0), "epic", GenerateOptions(SamplingConfig(max_new_tokens=1)))
    assert out.stats.num_prompt_tokens == 8


@pytest.mark.parametrize("bad_id", [-1, 10**9])
def test_a_token_id_outside_the_vocabulary_is_a_clear_error(lm, bad_id):
    vocab = lm.config.vocab_size
    with pytest.raises(ValueError, match=rf"prompt token id {bad_id} is outside .*vocabulary \[0, {vocab}\)"):
        generate(lm, [1, bad_id, 2], "full", sampling=SamplingConfig(max_new_tokens=1))


@pytest.mark.parametrize("ref, words", [
    (dict(start=0, end=999, src_start=0), r"covers prompt tokens \[0, 999\), past the prompt's 8 tokens"),
    (dict(start=5, end=2, src_start=0), r"needs 0 <= start <= end and src_start >= 0, got \[5, 2\) from 0"),
    (dict(start=0, end=4, src_start=-1), r"needs 0 <= start <= end and src_start >= 0"),
])
def test_a_span_ref_outside_its_prompt_is_a_clear_error(lm, ref, words):
    """A call's SpanRef that does not fit its prompt is refused where it is made, naming the span (it was planned
    or dropped without a word)."""
    from kvrelay.reuse import CallInput, SpanRef

    with pytest.raises(ValueError, match=rf"SpanRef of 'solver'.*{words}"):
        CallInput(_prompt(8, 0), [SpanRef(span_id="solver", **ref)])


def test_sampling_config_in_place_of_generate_options_is_named(lm):
    from kvrelay.engine import Engine

    engine = Engine(lm)
    for run in (engine.generate, engine.start, engine.begin):
        with pytest.raises(TypeError, match=r"options must be a GenerateOptions, got a SamplingConfig \(wrap it"):
            run(_prompt(8, 0), "full", SamplingConfig(max_new_tokens=2))
