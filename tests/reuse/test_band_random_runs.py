"""Relay with Gemma 3's kind of profile (a band entered and detected at one layer and ended at the top, a kept share,
pruning) over random reused runs: several spans, each stored with or without the hidden states its tokens carry into
the band (so they enter there, or from layer 0), apart or back to back, with new tokens between. Run in pieces sized
by their price (``PrefillTask.advance``: the server's way), the call gives what one forward gives."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine, GenerateOptions
from kvrelay.model.sampling import SamplingConfig
from kvrelay.reuse.base import CallInput, SpanRef
from tests.helpers import generate, publish, random_ids, tiny_lm

METHOD = "relay[band=1:1:3,keep_share=0.3,prune_share=0.25]"
LM = {}

# per span: (its stored length, where the reused run starts in it, the run's length, hidden states carried to layer
# 1 or not, new tokens before it)
SPANS = st.lists(st.tuples(st.integers(10, 24), st.integers(0, 4), st.integers(4, 12), st.booleans(),
                           st.integers(0, 4)), min_size=1, max_size=3)


def _call(lm, spans) -> tuple[KVStore, CallInput]:
    store = KVStore(1 << 30)
    ids, refs = [], []
    for i, (num_stored, src_start, num_run, carried, num_new) in enumerate(spans):
        stored = generate(lm, random_ids(num_stored, 10 + i), "full", store, SamplingConfig(max_new_tokens=1),
                          keep_cache=True, capture_layers=(1,) if carried else ())
        publish(store, f"s{i}", stored, lm)
        src_start = min(src_start, num_stored - 1)
        run = stored.prompt_ids[src_start : src_start + num_run]
        ids += random_ids(num_new, 30 + i)
        refs.append(SpanRef(len(ids), len(ids) + len(run), f"s{i}", src_start))
        ids += run
    return store, CallInput(ids + random_ids(5, 99), refs=refs)


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(spans=SPANS, budget=st.integers(1, 12))
def test_relay_over_random_runs_in_priced_pieces_gives_the_one_forward_results(spans, budget):
    lm = LM.get("gemma3") or LM.setdefault("gemma3", tiny_lm("gemma3"))  # sliding windows, as Gemma 3's
    store, call = _call(lm, spans)
    engine = Engine(lm, store)
    options = GenerateOptions(SamplingConfig(max_new_tokens=1), keep_cache=True)
    whole = engine.start(call, METHOD, options)
    task = engine.begin(call, METHOD, options)
    while not task.done:
        assert task.upcoming_layer() is not None  # a band selecting as it goes: priced a layer at a time
        task.advance(budget)
    seq = task.sequence()
    torch.testing.assert_close(seq.first_logits, whole.first_logits, atol=1e-4, rtol=0)
    assert seq.stats.num_computed_token_layers == whole.stats.num_computed_token_layers
