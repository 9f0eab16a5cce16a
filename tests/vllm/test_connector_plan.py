"""The connector's claim: which prefix of a request's uncomputed tokens it takes, and what it computes there."""

from __future__ import annotations

import pytest

from kvrelay.errors import ConfigError
from kvrelay.vllm.plan import Run, plan_load

NEEDS_VLLM = False  # pure logic: runs in the main venv
SPAN = tuple(range(1000, 1100))  # a stored call's 100 tokens at positions 0..99
TOKENS = {"s": SPAN, "t": tuple(range(2000, 2040))}


def tokens_of(span_id: str) -> tuple[int, ...]:
    return TOKENS[span_id]


def test_an_exact_prefix_past_vllms_own_is_loaded_whole():
    prompt = list(SPAN[:80]) + [7] * 10
    plan = plan_load(prompt, 32, [Run(0, 80, "s", 0)], tokens_of, "epic", epic_k=16)
    assert (plan.num_computed, plan.end, plan.recompute) == (32, 80, [])
    assert [(p.src_start, p.dst_start, p.num_tokens, p.exact) for p in plan.pieces] == [(32, 32, 48, True)]


def test_a_moved_run_after_a_gap_recomputes_the_gap_and_epics_first_tokens():
    prompt = [5] * 10 + list(SPAN[:80]) + [6] * 5
    plan = plan_load(prompt, 0, [Run(10, 90, "s", 0)], tokens_of, "epic", epic_k=16)
    assert plan.end == 90
    assert plan.recompute == list(range(0, 26))  # the 10-token gap, then the run's first 16
    assert plan.pieces[0].exact is False and plan.num_loaded == 64


def test_naive_recomputes_only_the_gaps():
    prompt = [5] * 10 + list(SPAN[:80]) + [6] * 5
    plan = plan_load(prompt, 0, [Run(10, 90, "s", 0)], tokens_of, "naive")
    assert plan.recompute == list(range(10)) and plan.num_loaded == 80


def test_a_run_at_its_own_positions_after_other_tokens_is_not_exact():
    prompt = [5] * 10 + list(SPAN[10:60]) + [6] * 5  # SPAN's tokens 10.. at positions 10.., other tokens before
    plan = plan_load(prompt, 0, [Run(10, 60, "s", 10)], tokens_of, "epic", epic_k=4)
    assert plan.pieces[0].exact is False and plan.recompute == list(range(14))


def test_a_run_past_a_longer_gap_than_it_saves_is_not_claimed():
    prompt = list(SPAN[:20]) + [9] * 180 + list(TOKENS["t"]) + [8]
    runs = [Run(0, 20, "s", 0), Run(200, 240, "t", 0)]
    plan = plan_load(prompt, 0, runs, tokens_of, "epic", epic_k=16)
    assert (plan.end, plan.recompute) == (20, [])


def test_the_last_prompt_token_is_never_claimed():
    prompt = list(SPAN[:50])
    plan = plan_load(prompt, 0, [Run(0, 50, "s", 0)], tokens_of)
    assert plan.end == 49


def test_runs_inside_vllms_own_prefix_or_too_short_claim_nothing():
    prompt = list(SPAN[:40]) + [3] * 30
    assert plan_load(prompt, 32, [Run(0, 40, "s", 0)], tokens_of, min_tokens=16) is None
    assert plan_load(prompt, 64, [Run(0, 40, "s", 0)], tokens_of) is None
    assert plan_load(prompt, 0, [], tokens_of) is None


def test_an_unknown_method_is_refused_by_name():
    with pytest.raises(ConfigError, match="naive, epic, cacheblend, relay"):
        plan_load([1, 2, 3], 0, [], tokens_of, "kvcomm")


def test_a_scheduled_method_claims_every_token_but_the_last_and_runs_over_the_whole_prompt():
    """relay and cacheblend choose from the new tokens' attention: the connector's forward runs over the whole prompt,
    and what it computes at every layer (the gaps, the new tokens) is its ``recompute``; each run pays, even past a
    gap longer than it (the connector's forward computes those tokens anyway)."""
    prompt = [5] * 10 + list(SPAN[:80]) + [6] * 5
    plan = plan_load(prompt, 0, [Run(10, 90, "s", 0)], tokens_of, "relay[keep_share=0.2]")
    assert (plan.end, plan.run_end, plan.num_loaded) == (94, 95, 80)
    assert plan.recompute == [*range(10), *range(90, 94)] and plan.pieces[0].exact is False
    prompt = list(SPAN[:20]) + [9] * 30 + list(TOKENS["t"]) + [8]
    plan = plan_load(prompt, 0, [Run(0, 20, "s", 0), Run(50, 90, "t", 0)], tokens_of, "cacheblend")
    assert plan.end == 90 and [p.num_tokens for p in plan.pieces] == [20, 40] and plan.num_loaded == 60
    assert plan_load(prompt, 0, [], tokens_of, "relay") is None


@pytest.mark.parametrize("method", ["cacheblend", "relay", "epic"])
def test_a_short_span_before_a_long_new_tail_is_not_claimed(method):
    """20 span tokens, then 4,000 new ones: a scheduled claim would have the connector compute the 4,000 at every
    layer in its own forward (outside vLLM's chunked prefill) to save 20: it claims nothing, and vLLM prefills it."""
    prompt = list(SPAN[10:30]) + [9] * 4000  # a moved run: SPAN's tokens 10..29 at positions 0..19
    assert plan_load(prompt, 0, [Run(0, 20, "s", 10)], tokens_of, method) is None


@pytest.mark.parametrize("method", ["cacheblend", "relay"])
def test_a_scheduled_claim_pays_for_the_gaps_and_the_tail_together(method):
    """Loaded must exceed what the connector computes, gaps, tail and the prompt's last token included (its forward
    runs that one too): 60 loaded against 30 + 28 + 1 claims, against 30 + 29 + 1 it does not."""
    runs = [Run(0, 20, "s", 0), Run(50, 90, "t", 0)]
    prompt = list(SPAN[:20]) + [9] * 30 + list(TOKENS["t"]) + [8] * 29  # tail: 28 claimed and computed, then the last
    plan = plan_load(prompt, 0, runs, tokens_of, method)
    assert plan.num_loaded == 60 and len(plan.recompute) == 58 and plan.run_end - plan.end == 1
    assert plan_load(prompt + [8], 0, runs, tokens_of, method) is None
