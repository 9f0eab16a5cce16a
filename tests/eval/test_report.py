"""Metric definitions on hand-made rows."""

import pytest

from kvrelay.eval.report import CallRow, format_table, summarize


def _row(method, ttft, full, prefix, ideal, prompt_tl, reused_tl, span_tl, recomputed_tl, agree=True, kl=0.0,
         greedy=True, agent="b", fallback=None):
    return CallRow("p", agent, 1, method, 10, 2, ttft, full, prefix, ideal, prompt_tl, reused_tl, span_tl,
                   recomputed_tl, agree, kl, greedy, fallback)


def test_summary_definitions():
    rows = [
        _row("m", 10.0, 100.0, 50.0, 5.0, 100, 80, 90, 10),
        _row("m", 20.0, 20.0, 40.0, 10.0, 100, 50, 60, 10, agree=False, kl=0.5, greedy=False),
        _row("m", 30.0, 90.0, 30.0, 30.0, 200, 0, 0, 0, fallback="gate", agent="c"),
    ]
    s = summarize(rows, {"m": 0.5})["m"]
    assert s["ttft_ms_median"] == 20.0
    assert s["speedup_vs_full"] == 3.0  # ratios 10, 1, 3 -> median 3 (not 210/60)
    assert s["speedup_vs_prefix"] == 2.0  # ratios 5, 2, 1
    assert s["ideal_speedup"] == 3.0  # full/ideal: 20, 2, 3
    assert s["reuse_rate"] == pytest.approx(130 / 400)  # pooled token-layers
    assert s["recompute_frac"] == pytest.approx(20 / 150)
    assert s["first_token_agreement"] == pytest.approx(2 / 3)
    assert s["greedy_match_rate"] == pytest.approx(2 / 3)
    assert s["kl_first_token"] == pytest.approx(0.5 / 3)
    assert s["fallback_rate"] == pytest.approx(1 / 3)
    assert s["reuse_rate_per_call"] == pytest.approx(2 / 3)
    assert s["accuracy"] == 0.5 and s["n_calls"] == 3
    assert s["by_agent"]["b"]["n_calls"] == 2 and s["by_agent"]["c"]["speedup_vs_full"] == 3.0
    assert "n/a" in format_table({"m": s}, fidelity_meaningful=False)
