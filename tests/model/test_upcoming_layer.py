"""A forward's price of its next layer (``LayerForward.upcoming``, what a piece is sized by) where a band selects at a
layer that tokens enter: relay with one span carried to its band's first layer and one without a carried state (it
enters at layer 0), so no admission: the selector chooses at that layer among every span token, the entering ones
included, and the price reads the attention mass rows of that same active set."""

from __future__ import annotations

import pytest
import torch

from kvrelay.cache.store import KVStore
from kvrelay.model.prefill_state import num_scores
from kvrelay.model.sampling import SamplingConfig
from kvrelay.model.schedule import LayerView
from kvrelay.reuse.base import CallInput, SpanRef
from tests.helpers import generate, publish, random_ids, tiny_lm
from tests.model.test_row_chunks import ATOL, _planned

# Gemma 3's relay profile in small: a band entered, detected at 1 and ended at the top, a kept share, pruning
METHOD = "relay[band=1:1:3,keep_share=0.3,prune_share=0.25]"


def mixed_call(family: str):
    """(lm, store, call): span "carried" (layer 1's hidden states captured) and span "bare" (none), both reused in a
    call that holds them apart, with new tokens between and after."""
    lm = tiny_lm(family)
    store = KVStore(1 << 30)
    carried = generate(lm, random_ids(20, 1), "full", store, SamplingConfig(max_new_tokens=1), keep_cache=True,
                       capture_layers=(1,))
    publish(store, "carried", carried, lm)
    bare = generate(lm, random_ids(16, 2), "full", store, SamplingConfig(max_new_tokens=1), keep_cache=True)
    publish(store, "bare", bare, lm)
    head, mid, tail = random_ids(4, 3), random_ids(3, 4), random_ids(5, 5)
    ids = head + bare.prompt_ids[2:14] + mid + carried.prompt_ids[4:18] + tail
    start_carried = len(head) + 12 + len(mid)
    refs = [SpanRef(len(head), len(head) + 12, "bare", 2), SpanRef(start_carried, start_carried + 14, "carried", 4)]
    return lm, store, CallInput(ids, refs=refs)


@pytest.mark.parametrize("family", ["llama3", "gemma3"])
def test_a_band_selecting_where_tokens_enter_is_priced_over_the_set_they_joined(monkeypatch, family):
    lm, store, call = mixed_call(family)
    plan, cache = _planned(lm, store, call, METHOD)
    entries = plan.schedule.entries(len(call.prompt_ids))
    assert sorted(entries) == [0, 1] and not plan.schedule.admits_at(1)  # both ways in: the selector chooses at 1
    read = []
    original_mass = LayerView.attention_mass

    def mass(view, rows):
        read.append((view.layer, rows.numel()))
        return original_mass(view, rows)

    monkeypatch.setattr(LayerView, "attention_mass", mass)
    model, ids = lm.model, torch.tensor(call.prompt_ids)
    forward = model.begin_prefill(ids, cache, plan.schedule)
    priced = {}
    while not forward.done:
        layer, num_active = forward.next_layer, forward.act.idx.numel()
        entry = forward.entries.get(layer)
        num_entering = entry.token_idx.numel() if entry is not None else 0
        priced[layer] = (num_active + num_entering, forward.upcoming())
        model.prefill_layers(forward, lambda: False)  # this layer alone
    result = model.finish_prefill(forward)
    monkeypatch.undo()
    # the choice at 1 read the new tokens' mass once, and the price of layer 1 counted those very rows' scores
    ((layer, num_mass_rows),) = read
    n = len(call.prompt_ids)
    num_rows, (tokens, scores) = priced[1]
    assert layer == 1 and num_mass_rows == len(call.prompt_ids) - 26
    assert num_rows == n  # every token active at 1: its attention the causal triangle, plus the mass rows' scores
    assert (tokens, scores) == (n, n * (n + 1) // 2 + num_scores(num_mass_rows, n))
    # and the forward priced layer by layer is the one forward's
    whole_plan, whole_cache = _planned(lm, store, call, METHOD)
    whole = model.prefill(ids, whole_cache, whole_plan.schedule)
    torch.testing.assert_close(result.logits, whole.logits, atol=ATOL, rtol=0)
