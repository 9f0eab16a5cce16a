"""A scheduled prefill whose layers run as chunks of their rows (``Transformer.prefill_rows``) gives one forward's
logits, every layer's KV and the same selection, up to float rounding."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvrelay.cache.kv import SequenceKV
from kvrelay.engine import Engine
from kvrelay.engine.call import load_plan, plan_call
from kvrelay.model.schedule import Schedule
from kvrelay.reuse.base import CallInput
from tests.helpers import relayed_call

# the bands with span tokens: cacheblend (from layer 0, selects at 1, its top at 3 selecting too), relay entering at
# 1 from carried states (selects at 2), relay's admission (selects as they enter), relay pruning every band layer
# above its selection with drift moving the cached K/V of the tokens it leaves
BANDS = ["cacheblend", "relay[band=1:2:3]", "relay[band=1:1:3]",
         "relay[band=0:1:3,prune_share=0.5,drift=0.3,span_openings=0,keep_share=0.8]"]
ATOL = 1e-5  # fp32: a matmul over fewer rows or attention over fewer keys rounds differently, ~1e-7 here


@pytest.fixture(scope="module", params=["llama3", "gemma3"])  # gemma3: sliding windows shorter than a chunk's reach
def setup(request):
    return relayed_call(request.param)


def _planned(lm, store, call: CallInput, method: str):
    plan, cache = plan_call(lm, Engine(lm, store).method(method), call, store, len(call.prompt_ids) + 1)
    # NaN wherever nothing was written yet: a pooled buffer may hold this very prefill's K/V from an earlier test, which
    # would hide a chunk that reads a slot before it is written
    cache.k.fill_(float("nan"))
    cache.v.fill_(float("nan"))
    load_plan(lm, plan, cache, store)
    plan.schedule.capture_layers = (1,)
    return plan, cache


def _in_rows(lm, store, call: CallInput, method: str, sizes: list[int]):
    """The prefill with every layer as row chunks of ``sizes`` rows (cycled): (result, plan, cache, chunks run)."""
    plan, cache = _planned(lm, store, call, method)
    model = lm.model
    forward = model.begin_prefill(torch.tensor(call.prompt_ids), cache, plan.schedule)
    sizes, chunks = itertools.cycle(sizes), []
    while not forward.done:
        layer, size = forward.next_layer, next(sizes)
        chunks.append((layer, model.prefill_rows(forward, size), size))
    return model.finish_prefill(forward), plan, cache, chunks


@pytest.mark.parametrize("method", BANDS)
@pytest.mark.parametrize("sizes", [[1], [3, 16, 5]])
def test_a_band_in_row_chunks_gives_one_forwards_logits_kv_and_selection(setup, method, sizes):
    lm, store, call = setup
    n = len(call.prompt_ids)
    plan, cache = _planned(lm, store, call, method)
    whole = lm.model.prefill(torch.tensor(call.prompt_ids), cache, plan.schedule)
    result, rows_plan, rows_cache, chunks = _in_rows(lm, store, call, method, sizes)
    assert plan.schedule.span_idx.numel() == 10 and plan.schedule.num_selected is not None
    assert len({layer for layer, _, _ in chunks}) == lm.config.num_layers  # every layer ran as row chunks ...
    assert all(0 < num <= size for _, num, size in chunks)  # ... of at most the rows asked for
    torch.testing.assert_close(result.logits, whole.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(rows_cache.k[:, :, :n], cache.k[:, :, :n], atol=ATOL, rtol=0)
    torch.testing.assert_close(rows_cache.v[:, :, :n], cache.v[:, :, :n], atol=ATOL, rtol=0)
    assert rows_plan.schedule.num_selected == plan.schedule.num_selected
    assert rows_plan.schedule.num_pruned == plan.schedule.num_pruned
    assert result.num_computed_token_layers == whole.num_computed_token_layers
    assert result.captured.keys() == whole.captured.keys()
    for layer, (idx, h) in whole.captured.items():
        assert torch.equal(result.captured[layer][0], idx)
        torch.testing.assert_close(result.captured[layer][1], h, atol=ATOL, rtol=0)


def test_the_pruning_band_selects_at_every_band_layer(setup):
    """The pruning band of ``BANDS`` drops tokens above its selection (so the row chunks of those selecting layers
    are tested for what they keep, not only for an unchanged set)."""
    lm, store, call = setup
    plan, cache = _planned(lm, store, call, BANDS[-1])
    lm.model.prefill(torch.tensor(call.prompt_ids), cache, plan.schedule)
    assert plan.schedule.num_pruned > 0 and 0 < plan.schedule.num_selected < 10


def test_a_layer_not_begun_runs_whole_and_bit_for_bit(setup):
    """``prefill_rows(forward)`` on a layer not begun in row chunks is the whole layer: one forward's bits."""
    lm, store, call = setup
    plan, cache = _planned(lm, store, call, "cacheblend")
    whole = lm.model.prefill(torch.tensor(call.prompt_ids), cache, plan.schedule)
    plan2, cache2 = _planned(lm, store, call, "cacheblend")
    forward = lm.model.begin_prefill(torch.tensor(call.prompt_ids), cache2, plan2.schedule)
    while not forward.done:
        assert lm.model.prefill_rows(forward) == 0 and forward.partial is None
    assert torch.equal(lm.model.finish_prefill(forward).logits, whole.logits)
    n = len(call.prompt_ids)
    assert torch.equal(cache2.k[:, :, :n], cache.k[:, :, :n]) and torch.equal(cache2.v[:, :, :n], cache.v[:, :, :n])


def test_a_layer_is_priced_by_the_attention_scores_it_computes(setup):
    """Every position active: the causal triangle (SDPA skips what causality hides); a selected set, or a chunk of its
    rows, attends through a mask, which hides scores without skipping their work: each row against every key up to
    the chunk's last position."""
    lm, store, call = setup
    n = len(call.prompt_ids)
    plan, cache = _planned(lm, store, call, "cacheblend")
    model, schedule = lm.model, plan.schedule
    every = model.begin_prefill(torch.tensor(call.prompt_ids), _planned(lm, store, call, "full")[1], Schedule())
    assert every.upcoming() == (n, n * (n + 1) // 2)
    forward = model.begin_prefill(torch.tensor(call.prompt_ids), cache, schedule)
    num = len(forward.entries[0].token_idx)  # the reused prefix is not active
    assert num < n and forward.upcoming() == (num, num * n)
    while forward.next_layer <= schedule.select_layer:
        model.prefill_rows(forward)
    kept = forward.act.idx.tolist()
    assert len(kept) < n and forward.upcoming() == (len(kept), len(kept) * n)
    model.start_layer(forward)
    assert forward.next_rows() == (kept, True) and forward.upcoming() == (len(kept), len(kept) * (kept[-1] + 1))
    model.prefill_rows(forward, 5)
    assert forward.upcoming() == (len(kept) - 5, (len(kept) - 5) * (kept[-1] + 1))


@pytest.mark.parametrize("probe_attention", [False, True])
def test_rksc_exit_and_attention_probe_in_row_chunks_match_one_forward(setup, probe_attention):
    """RKSC's layer exit (tested on the last token's state once its layer's last chunk ran) stops at the same layer,
    with the same logits; its attention probe (``after_layer`` reading the whole layer's view) sees the same mass."""
    from kvrelay.branches.rksc import RKSCSchedule

    lm, _, call = setup
    ids = torch.tensor(call.prompt_ids)
    n, model = len(ids), lm.model

    def schedule() -> RKSCSchedule:  # an exit that fires at layer 2 (entropy below 1e9 and moving less than 1e9)
        return RKSCSchedule(0, model.logits_from_hidden, theta=1e9, eps=1e9, min_layer=1,
                            probe_attention=probe_attention)

    def cache():
        c = SequenceKV(lm.config, model.dtype, model.device, capacity=n + 1)
        c.k.fill_(float("nan"))
        c.v.fill_(float("nan"))
        return c

    one = schedule()
    whole = model.prefill(ids, cache(), one)
    rows = schedule()
    forward = model.begin_prefill(ids, cache(), rows)
    while not forward.done:
        model.prefill_rows(forward, 7)
    result = model.finish_prefill(forward)
    assert whole.exit_layer == result.exit_layer == 2
    torch.testing.assert_close(result.logits, whole.logits, atol=ATOL, rtol=0)
    assert rows.entropies.keys() == one.entropies.keys()
    if probe_attention:
        torch.testing.assert_close(rows.position_mass(), one.position_mass(), atol=ATOL, rtol=0)
