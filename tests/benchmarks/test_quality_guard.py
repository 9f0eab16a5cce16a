"""benchmarks/quality_guard.py's scoring: the guard replayed on rows of measured calls (synthetic rows here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from quality_guard import (
    WORKLOAD_OFFSETS,
    bench_rung_settings,
    calls_path,
    config_from_args,
    main,
    problem_range,
    role_report,
    workload_offsets,
)

from kvrelay.eval.result_files import write_json_gz
from kvrelay.quality import QualityConfig

# kvrelay/profiles/ (read as files: kvrelay.reuse.profile would import torch into this torch-free test)
SHIPPED_PROFILES = Path(__file__).resolve().parents[2] / "kvrelay" / "profiles"


def rows(num_calls: int, naive_kl: float) -> list[dict]:
    def rung(kl: float, agree: bool, reused: int) -> dict:
        return {"kl": kl, "agree": agree, "reused_token_layers": reused, "prompt_token_layers": 100, "ttft_ms": 10.0}

    return [{"workload": "w", "problem_id": f"p-{i}", "agent": "critic", "position": 1, "decode_ms": 90.0,
             "rungs": {"naive": rung(naive_kl, naive_kl < 0.1, 80), "relay": rung(0.001, True, 60),
                       "prefix": rung(0.0, True, 10), "full": rung(0.0, True, 0)}} for i in range(num_calls)]


def test_the_best_static_rung_is_the_cheapest_that_meets_the_target():
    report = role_report(rows(60, naive_kl=0.3), QualityConfig())
    assert report["best_static"] == "relay" and report["static"]["naive"]["meets_target"] is False
    assert report["quality_after_20"]["kl_mean"] <= 0.05 and report["meets_target_after_20"]
    assert report["reuse_vs_best_static"] == report["reuse"] / 0.6


def test_naive_is_best_when_it_meets_the_target():
    report = role_report(rows(60, naive_kl=0.001), QualityConfig())
    assert report["best_static"] == "naive"
    assert report["rung_calls"]["naive"] > 0  # the guard earned it


def test_the_guard_sees_only_its_shadowed_calls_and_their_cost_is_counted():
    config = QualityConfig()
    report = role_report(rows(100, naive_kl=0.001), config)
    num_shadowed = report["num_shadowed"]
    assert num_shadowed == sum(s for _, s, _, _ in report["trace"]) < 100
    assert report["guard_num_samples"] == num_shadowed
    live_ms = 100 * (10.0 + 90.0)
    assert report["shadow_share"] == num_shadowed * 10.0 / (live_ms + num_shadowed * 10.0)
    assert report["shadow_share_at_sample_rate"] == 0.05 * 1000.0 / (live_ms + 0.05 * 1000.0)


def test_replay_config_flags():
    default, overrides = config_from_args(QualityConfig().start, [])
    assert default == QualityConfig() and overrides == {}
    strict, overrides = config_from_args("safest", ["trust_start=false", "kl_cap_factor=2"])
    assert strict.start is None and strict.trust_start is False and strict.kl_cap_factor == 2.0
    assert overrides == {"trust_start": False, "kl_cap_factor": 2.0}
    for bad in ("trust_start=maybe", "no_such_field=1", "window"):
        with pytest.raises(SystemExit, match="--set"):
            config_from_args(None, [bad])


def test_offset_moves_every_workload_and_the_report_names_the_problems():
    workloads = ["gsm8k-chain3", "mmlu-fc3", "other"]
    assert workload_offsets(workloads, None) == {"gsm8k-chain3": WORKLOAD_OFFSETS["gsm8k-chain3"],
                                                 "mmlu-fc3": WORKLOAD_OFFSETS["mmlu-fc3"], "other": 0}
    assert workload_offsets(workloads, 900) == {"gsm8k-chain3": 900, "mmlu-fc3": 900, "other": 900}
    assert workload_offsets(workloads, 0) == {"gsm8k-chain3": 0, "mmlu-fc3": 0, "other": 0}
    measured = [{**row, "workload": w, "problem_id": f"{w}-{900 + i // 2}"}
                for w in ("a", "b") for i, row in enumerate(rows(4, naive_kl=0.001))]
    assert problem_range(measured) == {"a": ["a-900", "a-901"], "b": ["b-900", "b-901"]}


def test_a_bench_replay_records_what_each_rung_resolved_per_workload(tmp_path):
    relay = "relay[top_r=0.4]"
    files = []
    for workload, top_r in (("gsm8k-chain3", 0.4), ("humaneval-adr", 0.3)):
        path = tmp_path / f"{workload}.json"
        path.write_text(json.dumps({"workload": workload, "calls": [], "method_settings": {
            relay: {"layers": [3, 3, 11], "selector": {"keep_share": top_r}}, "other": {"layers": [0, 0, 0]}}}))
        files.append(str(path))
    got = bench_rung_settings(files, {"naive": "naive", "relay": relay})
    assert got == {"relay": {"gsm8k-chain3": {"layers": [3, 3, 11], "selector": {"keep_share": 0.4}},
                             "humaneval-adr": {"layers": [3, 3, 11], "selector": {"keep_share": 0.3}}}}


def test_default_offsets_skip_every_problem_a_shipped_profile_was_calibrated_on():
    """The benchmark's claim: workloads the defaults were not tuned on. A profile calibrated on a workload's default
    data (``"default"``; GSM8K's calibration reads train.jsonl, the benchmark the test split) used problems
    [offset, offset + problems); the benchmark's problems must start after them."""
    checked = 0
    for path in SHIPPED_PROFILES.glob("relay-*.json"):
        calibration = json.loads(path.read_text())["calibration"]
        ranges = [(calibration.get("workload"), calibration.get("data"), calibration.get("offset", 0),
                   calibration.get("problems", 0))]
        ranges += [(name, data, calibration.get("selector_offset", 0), calibration.get("selector_problems", 0))
                   for name, data in calibration.get("selector_workloads", {}).items()]
        for name, data, first, num_problems in ranges:
            if name in WORKLOAD_OFFSETS and data in (None, "default"):
                checked += 1
                assert first + num_problems <= WORKLOAD_OFFSETS[name], (path.name, name, first, num_problems)
    assert checked  # a shipped profile calibrated on a workload's default data is what this guards


def test_the_rows_are_kept_gzipped_and_a_replay_reads_them_gzipped_or_plain(tmp_path):
    measured = rows(24, naive_kl=0.001)
    gzipped = calls_path(str(tmp_path / "run.json"))
    assert gzipped.name == "run.calls.json.gz"
    write_json_gz(gzipped, measured)
    assert gzipped.read_bytes()[:2] == b"\x1f\x8b"
    plain = tmp_path / "old.calls.json"
    plain.write_text(json.dumps(measured))
    reports = []
    for source in (gzipped, plain):
        out = tmp_path / f"{source.name}.report.json"
        main(["--calls-json", str(source), "--json", str(out)])
        reports.append(json.loads(out.read_text())["roles"])
    assert reports[0] == reports[1] == {"w/critic": role_report(measured, QualityConfig())}
