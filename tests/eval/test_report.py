"""Metric definitions on hand-made rows."""

import subprocess
import sys
from dataclasses import asdict, replace

import pytest

from kvrelay.eval.report import CallRow, format_table, merge_results, summarize


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


def _lane(rows, n, peak, accuracy=None):
    results = summarize(rows, accuracy)
    for summary in results.values():
        summary["peak_store_bytes"] = peak
    return {"workload": "w", "model": "m", "mode": "agent" if accuracy is None else "e2e", "n": n,
            "results": results, "calls": [asdict(r) for r in rows]}


def test_merge_results_equals_one_summary_over_all_rows():
    a = [replace(_row("full", 10.0, 10.0, 10.0, 2.0, 100, 0, 0, 0), problem_id="p0"),
         replace(_row("relay", 4.0, 10.0, 10.0, 2.0, 100, 70, 80, 10), problem_id="p0")]
    b = [replace(_row("full", 30.0, 30.0, 30.0, 3.0, 50, 0, 0, 0), problem_id="p1"),
         replace(_row("relay", 5.0, 30.0, 30.0, 3.0, 50, 20, 40, 20, agree=False), problem_id="p1")]
    merged = merge_results([_lane(a, 1, 7), _lane(b, 1, 9)])
    expected = summarize(a + b)
    for m in ("full", "relay"):
        assert merged["results"][m] == {**expected[m], "peak_store_bytes": 9}
    assert merged["n"] == 2 and len(merged["calls"]) == 4
    assert merged["results"]["relay"]["reuse_rate"] == pytest.approx(90 / 150)
    assert merged["results"]["relay"]["speedup_vs_full"] == pytest.approx((2.5 + 6.0) / 2)
    with pytest.raises(ValueError, match="problem 'p0' is in lanes 0 and 1"):
        merge_results([_lane(a, 1, 7), _lane(a, 1, 7)])
    with pytest.raises(ValueError, match="differ in workload"):
        merge_results([_lane(a, 1, 7), {**_lane(b, 1, 9), "workload": "v"}])
    with pytest.raises(ValueError, match="different methods"):
        merge_results([_lane(a, 1, 7), _lane(b[:1], 1, 9)])


def test_merge_results_weights_e2e_accuracy_by_problems():
    a = [replace(_row(m, 10.0, 10.0, 10.0, None, 100, 0, 0, 0), problem_id="p0") for m in ("full", "relay")]
    b = [replace(_row(m, 10.0, 10.0, 10.0, None, 100, 0, 0, 0), problem_id=f"p{i}") for i in (1, 2, 3)
         for m in ("full", "relay")]
    merged = merge_results([_lane(a, 1, 0, {"full": 1.0, "relay": 0.0}), _lane(b, 3, 0, {"full": 0.0, "relay": 2 / 3})])
    assert merged["n"] == 4 and merged["mode"] == "e2e"
    assert merged["results"]["full"]["accuracy"] == pytest.approx(0.25)
    assert merged["results"]["relay"]["accuracy"] == pytest.approx(0.5)


def test_near_tie_calls_are_counted_apart():
    # margins 0.5 (clear, agrees), 0.01 (near-tie, flips), 0.02 (exactly the bound: clear, flips)
    rows = [replace(_row("m", 1.0, 1.0, 1.0, 1.0, 10, 0, 0, 0), full_first_margin=0.5),
            replace(_row("m", 1.0, 1.0, 1.0, 1.0, 10, 0, 0, 0, agree=False), full_first_margin=0.01),
            replace(_row("m", 1.0, 1.0, 1.0, 1.0, 10, 0, 0, 0, agree=False), full_first_margin=0.02)]
    s = summarize(rows)["m"]
    assert s["first_token_agreement"] == pytest.approx(1 / 3)  # the plain metric is unchanged
    assert s["near_tie_rate"] == pytest.approx(1 / 3)
    assert s["first_token_agreement_clear"] == pytest.approx(1 / 2)
    assert "1st-clear" in format_table({"m": s})
    # rows from before the margin was recorded: unknown, not guessed
    old = summarize([_row("m", 1.0, 1.0, 1.0, 1.0, 10, 0, 0, 0)])["m"]
    assert old["near_tie_rate"] is None and old["first_token_agreement_clear"] is None


def test_report_bookkeeping_does_not_import_torch():
    # a fresh interpreter: this test session has torch loaded already
    code = "import sys, kvrelay.eval.report; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
