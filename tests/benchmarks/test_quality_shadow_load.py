"""benchmarks/quality_shadow_load.py's pure helpers (benchmarks/shadow_load_stats.py): percentiles, the ABAB plan and
pairing of phases, the /metrics diff, the split of each role's first calls, the decode rate and the downstream
calls; and its report (synthetic rows; no server)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from shadow_load_stats import (
    common_calls,
    compare_arms,
    decode_rate,
    decode_summary,
    metric_values,
    metrics_delta,
    percentile,
    phase_plan,
    ttft_summary,
    with_call_index,
)


def test_percentile_interpolates_between_order_statistics_as_numpy_does():
    values = [7.0, 1.0, 3.0, 10.0, 4.0]
    for q in (0.0, 0.25, 0.5, 0.9, 1.0):
        assert math.isclose(percentile(values, q), float(np.percentile(values, q * 100)))
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5  # the even case: between the middle two
    assert percentile([5.0], 0.9) == 5.0
    assert math.isnan(percentile([], 0.5))


def test_the_phases_alternate_the_arms_within_each_repeat():
    assert phase_plan(("on", "off"), 2) == [("on", 0), ("off", 0), ("on", 1), ("off", 1)]
    assert phase_plan(("on", "off"), 0) == []


def test_arms_are_paired_by_repeat_and_the_noise_is_the_spread_between_an_arms_repeats():
    phases = [{"arm": "on", "repeat": 0, "t": 110.0}, {"arm": "off", "repeat": 0, "t": 100.0},
              {"arm": "on", "repeat": 1, "t": 130.0}, {"arm": "off", "repeat": 1, "t": 80.0}]
    out = compare_arms(phases, "t")
    assert out["ratio_per_repeat"] == {0: pytest.approx(1.1), 1: pytest.approx(130 / 80)}
    assert out["ratio"] == pytest.approx(120 / 90)  # the arms' means over their repeats
    assert out["spread"] == {"on": pytest.approx(20 / 120), "off": pytest.approx(20 / 90)}
    assert out["noise"] == pytest.approx(20 / 90)
    assert out["within_noise"] is False  # 1.33 is further from 1 than 0.22
    quiet = [{**p, "t": p["t"] * (1.0 if p["arm"] == "off" else 90 / 120)} for p in phases]
    assert compare_arms(quiet, "t")["within_noise"] is True  # the same means: ratio 1
    single = compare_arms(phases[:2], "t")
    assert single["noise"] is None and single["within_noise"] is None and single["spread"]["on"] is None
    with pytest.raises(ValueError, match="both arms"):
        compare_arms(phases[:1], "t")


METRICS_BEFORE = """# HELP kvrelay_quality_shadow_runs_total shadow full references
# TYPE kvrelay_quality_shadow_runs_total counter
kvrelay_quality_shadow_runs_total 3.0
kvrelay_quality_shadow_runs_created 1.7e+09
# TYPE kvrelay_quality_rung_moves_total counter
kvrelay_quality_rung_moves_total{direction="up"} 1.0
# TYPE kvrelay_engine_ttft_seconds histogram
kvrelay_engine_ttft_seconds_bucket{le="0.5"} 2.0
kvrelay_engine_ttft_seconds_bucket{le="+Inf"} 4.0
kvrelay_engine_ttft_seconds_count 4.0
kvrelay_engine_ttft_seconds_sum 2.5
"""


def test_metrics_are_parsed_with_their_labels_and_diffed_by_name():
    before = metric_values(METRICS_BEFORE)
    assert before["kvrelay_quality_shadow_runs_total"] == 3.0
    assert before['kvrelay_quality_rung_moves_total{direction="up"}'] == 1.0
    assert before['kvrelay_engine_ttft_seconds_bucket{le="+Inf"}'] == 4.0
    after_text = (METRICS_BEFORE.replace("runs_total 3.0", "runs_total 10.0").replace("sum 2.5", "sum 9.0")
                  + "# TYPE kvrelay_quality_shadow_compute_seconds_total counter\n"
                    "kvrelay_quality_shadow_compute_seconds_total 4.25\n")
    after = metric_values(after_text)
    names = ("kvrelay_quality_shadow_runs_total", "kvrelay_engine_ttft_seconds_sum",
             "kvrelay_quality_shadow_compute_seconds_total", "kvrelay_absent_total")
    assert metrics_delta(before, after, names) == {"kvrelay_quality_shadow_runs_total": 7.0,
                                                   "kvrelay_engine_ttft_seconds_sum": 6.5,
                                                   "kvrelay_quality_shadow_compute_seconds_total": 4.25}


def test_each_roles_calls_are_counted_by_send_time_not_by_list_order():
    calls = [{"agent": "a", "sent_s": 5.0}, {"agent": "b", "sent_s": 1.0}, {"agent": "a", "sent_s": 0.5},
             {"agent": "a", "sent_s": 2.0}, {"agent": "b", "sent_s": 3.0}, {"agent": "b", "sent_s": 9.0}]
    ranked = with_call_index(calls)
    assert [(c["agent"], c["sent_s"], c["call_index"]) for c in ranked] == [
        ("a", 0.5, 0), ("b", 1.0, 0), ("a", 2.0, 1), ("b", 3.0, 1), ("a", 5.0, 2), ("b", 9.0, 2)]
    assert "call_index" not in calls[0]  # the caller's rows are left as they were


def call(client: int, chain: int, agent: str, index: int, ttft_ms: float) -> dict:
    return {"client": client, "chain": chain, "agent": agent, "call_index": index, "ttft_ms": ttft_ms,
            "total_ms": 2 * ttft_ms, "engine_ttft_ms": ttft_ms / 2, "queue_ms": 1.0, "method": "relay",
            "cached_tokens": 10}


def test_phases_are_compared_on_the_calls_every_phase_ran():
    full = [call(0, 0, "s", 0, 1.0), call(0, 0, "c", 0, 2.0), call(0, 1, "s", 1, 3.0), call(1, 0, "s", 2, 4.0)]
    cut = [call(0, 0, "s", 0, 5.0), call(0, 0, "c", 0, 6.0), call(1, 0, "s", 1, 7.0)]  # chain (0, 1) never ran
    kept = common_calls([full, cut])
    assert [c["ttft_ms"] for c in kept[0]] == [1.0, 2.0, 4.0] and [c["ttft_ms"] for c in kept[1]] == [5.0, 6.0, 7.0]
    assert common_calls([full]) == [full]


def test_ttft_is_split_at_each_roles_first_calls():
    calls = [call(0, 0, "s", 0, 10.0), call(0, 0, "c", 0, 20.0), call(0, 1, "s", 1, 30.0), call(0, 1, "c", 1, 100.0),
             call(0, 2, "s", 2, 50.0)]
    out = ttft_summary(calls, 2)
    assert out["ttft_ms_first_calls"]["num"] == 4 and out["ttft_ms_first_calls_p50"] == 25.0
    assert out["ttft_ms_after_first_calls"]["num"] == 1 and out["ttft_ms_after_first_calls_p50"] == 50.0
    assert out["ttft_ms_p50"] == 30.0 and out["num_calls"] == 5
    assert out["by_agent"]["c"]["p50"] == 60.0 and out["methods_after_first_calls"] == {"relay": 1}


def test_the_report_compares_cpu_per_call_run_and_leaves_out_a_view_with_no_calls():
    from quality_shadow_load import report

    head = {"first_calls_per_role": 16, "env": {"uptime_end": "x"}}
    phases = [{"arm": arm, "repeat": r, "server_cpu_s": cpu, "num_calls_run": n, "live_wall_s": 10.0}
              for arm, r, cpu, n in (("on", 0, 20.0, 10), ("off", 0, 20.0, 20), ("on", 1, 22.0, 10),
                                     ("off", 1, 18.0, 20))]
    calls = [[call(0, 0, "s", 0, 100.0)] for _ in phases]  # every call in the first-calls window
    out = report(head, phases, calls)
    assert out["compare"]["server_cpu_s_per_call_run"]["ratio"] == pytest.approx(2.1 / 0.95)  # not 21 / 19
    assert out["compare"]["ttft_ms_p50"]["ratio"] == 1.0
    assert "ttft_ms_after_first_calls_p50" not in out["compare"]


def test_a_calls_decode_rate_counts_the_tokens_after_its_first_over_the_time_after_its_first():
    assert decode_rate(11, 1.0, 3.0) == pytest.approx(5.0)
    assert decode_rate(1, 1.0, 3.0) is None and decode_rate(None, 1.0, 3.0) is None
    assert decode_rate(5, None, 3.0) is None and decode_rate(5, 3.0, 3.0) is None


def test_downstream_calls_are_those_after_a_chains_first_and_roles_can_be_counted_per_conversation():
    rows = [{"client": 0, "chain": ch, "agent": a, "step": st, "sent_s": ch * 10 + st, "ttft_ms": t,
             "decode_tokens_per_s": r}
            for ch, a, st, t, r in ((0, "x", 0, 900.0, 10.0), (0, "y", 1, 300.0, 20.0), (1, "x", 0, 800.0, None),
                                    (1, "y", 1, 500.0, 30.0))]
    out = decode_summary(rows)
    assert out["downstream_ttft_ms_p50"] == 400.0 and out["downstream_ttft_ms"]["num"] == 2
    assert out["decode_tokens_per_s_p50"] == 20.0 and out["decode_tokens_per_s"]["num"] == 3
    assert [r["call_index"] for r in with_call_index(rows)] == [0, 0, 1, 1]  # per agent: one namespace
    assert [r["call_index"] for r in with_call_index(rows, ("client", "chain", "agent"))] == [0, 0, 0, 0]
    assert math.isnan(decode_summary([{"agent": "x", "ttft_ms": 1.0}])["downstream_ttft_ms_p50"])  # rows of old
