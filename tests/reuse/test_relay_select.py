"""The selection rules relay's band applies (``kvrelay.reuse.relay_select``) on hand-made vectors."""


import pytest
import torch

from kvrelay.cache.kv import SequenceKV
from kvrelay.engine.call import run_plan
from kvrelay.errors import ConfigError
from kvrelay.model.schedule import LayerView, StaticSchedule
from kvrelay.reuse import get_method, relay_select
from kvrelay.reuse.base import Plan
from kvrelay.reuse.relay_policy import BandPolicy
from kvrelay.reuse.relay_select import (
    away_mass,
    drift_shift,
    position_prior,
    prune_mask,
    select_tokens,
    select_top,
    shared_context_len,
    spread_with_mean,
)
from tests.helpers import hf_model, tiny_lm


def test_selector_sets_on_hand_made_vectors():
    dev = torch.tensor([0.1, 0.1, 0.1, 0.9, 0.3, 0.1])  # mean 0.267: 1.5x = 0.4 -> token 3
    inf = torch.tensor([1.0, 1.0, 4.0, 1.0, 1.0, 1.0])  # mean 1.5: 1.45x = 2.175 -> token 2
    suffix = torch.tensor([False, False, False, False, False, True])
    keep = select_tokens(dev, inf, suffix, tau_dev=1.5, tau_inf=1.45)
    assert keep.tolist() == [False, False, True, True, False, True]
    assert select_tokens(dev, None, torch.zeros(6, dtype=torch.bool), 1.5, 1.45).nonzero().flatten().tolist() == [3]
    assert select_tokens(None, inf, torch.zeros(6, dtype=torch.bool), 1.5, 1.45).nonzero().flatten().tolist() == [2]


def test_budget_selector_keeps_the_top_share_by_normalized_score():
    dev = torch.tensor([0.1, 0.1, 0.1, 0.9, 0.3, 0.1])  # / mean 0.267: 0.375 ... 3.375, 1.125
    inf = torch.tensor([1.0, 1.0, 4.0, 1.0, 1.0, 1.0])  # / mean 1.5: 0.667 ... 2.667
    none = torch.zeros(6, dtype=torch.bool)
    suffix = torch.tensor([False, False, False, False, False, True])
    assert select_top(dev, inf, none, 2 / 6).nonzero().flatten().tolist() == [2, 3]  # 3.04 and 4.04
    big_inf = torch.tensor([10.0, 10.0, 40.0, 10.0, 25.0, 10.0])  # raw sums would pick 2 and 4
    assert select_top(dev, big_inf, none, 2 / 6).nonzero().flatten().tolist() == [2, 3]  # 2.66 and 3.95
    assert select_top(dev, inf, none, 3 / 6).nonzero().flatten().tolist() == [2, 3, 4]  # then 1.79
    assert select_top(dev, None, suffix, 1 / 6).nonzero().flatten().tolist() == [3, 5]  # ablated influence
    assert select_top(None, inf, none, 1 / 6).nonzero().flatten().tolist() == [2]
    assert not select_top(torch.zeros(6), None, none, 0.5).any()  # zero scores select nothing
    assert get_method("relay[keep_share=0.25]").keep_share == 0.25
    with pytest.raises(ConfigError, match="keep_share .top_r. must be in"):
        get_method("relay[keep_share=1.5]")
    with pytest.raises(ConfigError, match="keep_share is the budget's"):
        get_method("relay[selector=threshold,keep_share=0.2]")


def test_pruning_drops_low_deviation_tokens_and_never_the_spans_ends():
    dev = torch.tensor([0.001, 0.4, 0.01, 0.3, 0.2, 0.02, 0.5])
    ends = torch.tensor([True, False, False, False, False, False, True])  # a span's first and last token
    # share: the lowest 0.4 x 5 = 2 of the five others (0.01 and 0.02); the ends stay, whatever their deviation
    kept = prune_mask(dev, ends, 0.4)
    assert kept.mask.tolist() == [True, True, False, True, True, False, True] and kept.num == 5
    # the count of ends known on the host: the same tokens, counted without reading the mask back
    kept = prune_mask(dev, ends, 0.4, num_always=2)
    assert kept.mask.tolist() == [True, True, False, True, True, False, True] and kept.num == 5
    assert prune_mask(dev, ends, 0.1, num_always=2).mask.all()  # 0.1 x 5 rounds down to none
    assert get_method("relay[prune_share=0.1]").prune_share == 0.1
    with pytest.raises(ConfigError, match="prune_share .prune. must be"):
        get_method("relay[prune_share=1.5]")


def test_drift_shift_is_the_factor_times_the_sources_mean_move():
    k = torch.arange(24, dtype=torch.float32).reshape(2, 4, 3)  # [Hkv, active rows, hd]
    v = -k
    view = LayerView(5, torch.arange(4), None, None, k, v, torch.ones_like(k), torch.zeros_like(v),
                     _unrotate=lambda keys, rows: 10 * keys)  # a stand-in for undoing RoPE
    span_rows, sources = torch.tensor([1, 2, 3]), torch.tensor([True, False, True])  # rows 1 and 3
    shift_k, shift_v = drift_shift(view, span_rows, sources, 0.5)
    assert shift_k.shape == shift_v.shape == (2, 1, 3)
    torch.testing.assert_close(shift_k[:, 0], 0.5 * 10 * ((k[:, 1] + k[:, 3]) / 2 - 1))
    torch.testing.assert_close(shift_v[:, 0], 0.5 * (v[:, 1] + v[:, 3]) / 2)
    assert drift_shift(view, span_rows, torch.zeros(3, dtype=torch.bool), 0.5) is None
    with pytest.raises(ConfigError, match="drift needs pruning"):  # a profile's knobs
        BandPolicy.from_knobs({"top_r": 0.3, "drift": 0.3})
    # a spec's drift without pruning prunes nothing, so that its layers exist
    assert BandPolicy().overridden(drift=0.3).prune_share == 0.0
    with pytest.raises(ConfigError, match="drift must be in"):
        get_method("relay[prune_share=0.1,drift=1.5]")
    with pytest.raises(ConfigError, match="dense openings need span openings"):
        BandPolicy.from_knobs({"pre_dense": True})
    with pytest.raises(ConfigError, match="pre_dense must be true or false"):  # e.g. a profile's JSON string
        BandPolicy.from_knobs({"l_pre": 2, "pre_dense": "false"})


def test_zero_deviation_selects_nothing():
    zeros = torch.zeros(4)
    assert not select_tokens(zeros, zeros, torch.zeros(4, dtype=torch.bool), 1.5, 1.45).any()


def test_position_prior_ranks_a_spans_early_tokens_first_in_the_budget():
    dev = torch.tensor([0.0, 0.0, 0.0, 0.0])
    inf = torch.tensor([1.0, 1.0, 3.0, 3.0])  # mean 2: 0.5, 0.5, 1.5, 1.5
    none = torch.zeros(4, dtype=torch.bool)
    prior = position_prior(torch.tensor([0, 16, 48, 112]))  # 1, 1/2, 1/4, 1/8: mean 15/32
    assert torch.allclose(prior, torch.tensor([1.0, 0.5, 0.25, 0.125]))
    assert select_top(dev, inf, none, 0.5).nonzero().flatten().tolist() == [2, 3]  # influence alone
    # weight 1: 0.5 + 2.13, 0.5 + 1.07, 1.5 + 0.53, 1.5 + 0.27 -> the span's opening and its third token
    assert select_top(dev, inf, none, 0.5, [(prior, 1.0)]).nonzero().flatten().tolist() == [0, 2]
    assert select_top(dev, inf, none, 0.5, [(prior, 0.0)]).nonzero().flatten().tolist() == [2, 3]  # weight 0: none
    assert BandPolicy.from_knobs({"top_r": 0.3, "pos_prior": 1}).pos_prior == 1.0
    with pytest.raises(ConfigError, match="pos_prior needs the budget"):
        BandPolicy.from_knobs({"pos_prior": 1})
    with pytest.raises(ConfigError, match="pos_prior must be >= 0"):
        BandPolicy.from_knobs({"top_r": 0.3, "pos_prior": -1})


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])  # gemma3's layer 2 attends in an 8-token window
@pytest.mark.parametrize("rows_per_block", [256, 3])  # one attention block, or several
def test_away_mass_is_the_stored_attention_to_the_lost_context(family, rows_per_block, monkeypatch):
    monkeypatch.setattr(relay_select, "AWAY_ROWS_PER_BLOCK", rows_per_block)
    lm, layer, n = tiny_lm(family), 2, 30
    ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(1))
    cache = SequenceKV(lm.config, lm.model.dtype, lm.model.device, capacity=n)
    result, _ = run_plan(lm, ids, Plan(StaticSchedule(torch.arange(n))), cache, None, capture_layers=(layer,))
    hidden = result.captured[layer][1]  # [n, hidden]: every token active
    hf = hf_model(family)
    hf.config._attn_implementation = "eager"
    with torch.no_grad():
        probs = hf(ids[None], output_attentions=True).attentions[layer][0]  # [H, n, n]
    # a 14-token span stored at 12-25 whose first 4 tokens are not carried; its last 2 stored predecessors are
    # kept in the new prompt, so the lost context is 1-9
    src_end, num_carried, context_start = 26, 10, 10
    got = away_mass(lm.model.model.layers[layer], lm.model.rope_of(layer), hidden[src_end - num_carried : src_end],
                    cache.k[layer][:, :src_end], context_start, lm.config.window_at(layer))
    want = probs[:, src_end - num_carried : src_end, 1:context_start].sum(dim=(0, 2))
    assert got.shape == (num_carried,)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_shared_context_is_the_run_of_equal_tokens_right_before_the_span():
    stored = [9, 1, 2, 3, 4, 5, 6]  # the span starts at 4 (token 4)
    assert shared_context_len([7, 8, 4, 5], 2, stored, 4) == 0
    assert shared_context_len([7, 3, 4, 5], 2, stored, 4) == 1
    assert shared_context_len([1, 2, 3, 4, 5], 3, stored, 4) == 3  # the prompt starts there: nothing more to compare
    assert shared_context_len([5, 9, 1, 2, 3, 4], 5, stored, 4) == 4  # all of it, the sink included
    assert shared_context_len([7, 8, 4], 0, stored, 4) == 0


def test_unmeasured_tokens_count_as_average():
    values = torch.tensor([0.2, 1.6, 0.0])  # the last one measured, and 0: it lost nothing
    spread = spread_with_mean(values, torch.tensor([0, 2, 3]), 5)
    assert torch.allclose(spread, torch.tensor([0.2, 0.6, 1.6, 0.0, 0.6]))
    # with a heavy weight a token with no measure (1) ranks as average, over a measured low one (0)
    inf = torch.ones(4)
    none = torch.zeros(4, dtype=torch.bool)
    assert select_top(None, inf, none, 0.5, [(spread[:4], 100.0)]).nonzero().flatten().tolist() == [1, 2]


def test_away_needs_the_budget_form():
    assert BandPolicy.from_knobs({"top_r": 0.3, "away": 2}).away == 2.0
    with pytest.raises(ConfigError, match="away needs the budget"):
        BandPolicy.from_knobs({"away": 1})
    with pytest.raises(ConfigError, match="away must be >= 0"):
        BandPolicy.from_knobs({"top_r": 0.3, "away": -1})
