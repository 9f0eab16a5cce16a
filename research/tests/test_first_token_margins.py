"""research/first_token_margins.py: first-token agreement by full's margin, on hand-made rows."""

import pytest
from first_token_margins import BIN_EDGES, by_margin, summarize


def _row(margin: float, agree: bool, kl: float) -> dict:
    return {"full_first_margin": margin, "first_token_agree": agree, "kl_first_token": kl}


def test_bins_are_half_open_and_the_last_holds_a_margin_of_one():
    rows = [_row(0.0, False, 0.02), _row(0.004, True, 0.01), _row(0.005, False, 0.03), _row(0.0099, True, 0.01),
            _row(0.01, True, 0.0), _row(0.5, True, 0.0), _row(1.0, True, 0.004)]
    bins = by_margin(rows)
    assert [(b["lo"], b["hi"]) for b in bins] == list(zip(BIN_EDGES, BIN_EDGES[1:], strict=False))
    assert [b["calls"] for b in bins] == [2, 2, 1, 0, 0, 2]
    assert [b["agree"] for b in bins] == [1, 1, 1, 0, 0, 2]
    assert bins[0]["mean_kl"] == pytest.approx(0.015) and bins[5]["mean_kl"] == pytest.approx(0.002)
    assert bins[3]["mean_kl"] is None


def test_summary_counts_misses_the_target_allows_and_those_under_a_margin_of_0_01():
    rows = [_row(0.001, False, 0.1)] * 3 + [_row(0.008, True, 0.0), _row(0.015, False, 0.1)] + \
        [_row(0.03, False, 0.1)] * 2 + [_row(0.3, True, 0.0)] * 33  # 40 calls
    s = summarize(rows)
    assert (s["calls"], s["agree"], s["misses"]) == (40, 34, 6)
    assert s["misses_allowed_at_target"] == 2  # 5% of 40
    assert (s["calls_under_0.01"], s["misses_under_0.01"]) == (4, 3)
    assert (s["clear_calls"], s["clear_agree"]) == (35, 33)  # margin >= 0.02 (the bench's near-tie bound)
    assert summarize([_row(0.3, True, 0.0)] * 41)["misses_allowed_at_target"] == 2  # 39 of 41 is 0.951
    assert summarize([_row(0.3, True, 0.0)] * 600)["misses_allowed_at_target"] == 30
