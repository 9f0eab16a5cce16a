"""The demo's configuration (what it runs) and its where-the-time-went table."""

import io

import pytest

from kvrelay.demo import capped, demo_calls, run_demo
from kvrelay.errors import ConfigError
from kvrelay.eval.configs import DEMO_METHODS, DemoConfig
from kvrelay.eval.report import format_time_split
from kvrelay.pipeline.workloads import get_workload
from kvrelay.reuse import PIPELINE_METHODS, profile
from kvrelay.weights.loader import load_model


def test_demo_runs_the_references_and_repairs_with_a_kept_store():
    bench = DemoConfig().bench_config()
    assert {"full", "prefix"} <= set(DEMO_METHODS) and bench.methods[:2] == ("full", "prefix")
    repairs = set(bench.methods) - {"full", "prefix", "naive"}  # naive reuses without repair
    assert repairs and repairs <= set(PIPELINE_METHODS)
    assert bench.keep_store
    assert bench.limit >= 2  # a kept store shows something from the second problem on
    # every method (PIPELINE_METHODS) stays with `kvrelay bench`
    assert set(bench.methods) < set(PIPELINE_METHODS)


def test_capped_caps_every_agent_and_keeps_shorter_ones():
    workload = get_workload("gsm8k-chain3")
    before = [a.max_new_tokens for a in workload.spec.agents]
    after = [a.max_new_tokens for a in capped(workload, 64).spec.agents]
    assert after == [min(t, 64) for t in before] and after != before
    assert [a.max_new_tokens for a in workload.spec.agents] == before  # the registered workload is untouched
    with pytest.raises(ConfigError, match="max_new_tokens"):
        DemoConfig(max_new_tokens=0)


def test_time_split_shares_and_total():
    text = format_time_split([("install", 30.0), ("run", 90.0)])
    lines = {line.split()[0]: line.split() for line in text.splitlines()[2:]}
    assert lines["install"][1:] == ["30.0", "25%"] and lines["run"][1:] == ["90.0", "75%"]
    assert lines["total"][1] == "120.0"


def test_the_bar_counts_every_call_the_demo_waits_on():
    # gsm8k-chain3: solver, critic, finalizer; the critic and finalizer reuse (each method: greedy run + timed runs)
    assert demo_calls(get_workload("gsm8k-chain3"), problems=2, num_methods=4, repeats=3) == 2 * (3 + 2 * 4 * (1 + 3))


def test_run_demo_prints_the_time_table(tmp_path, monkeypatch, capsys):
    # random:tiny ships no relay profile: give it one, in an empty cache dir, whatever ran before
    monkeypatch.setenv("KVRELAY_CACHE", str(tmp_path / "cache"))
    lm = load_model("random:tiny")
    n = lm.config.num_layers
    monkeypatch.setattr(profile, "_PROFILES", {lm.fingerprint: profile.LayerProfile(
        lm.fingerprint, "random:tiny", n, 0, 1, n - 1, 0.9, [1.0] * n, [1.0] * n, [0.0] * n)})
    # as `make demo` runs it: install finished 5 s after make started
    monkeypatch.setenv("KVRELAY_MAKE_START", "1000.0")
    monkeypatch.setenv("KVRELAY_INSTALLED_AT", "1005.0")
    out = io.StringIO()
    result = run_demo(DemoConfig(model="random:tiny", problems=1, greedy_tokens=2, max_new_tokens=4,
                                 out=str(tmp_path)), out=out)
    text = out.getvalue()
    assert list(result["results"]) == list(DEMO_METHODS) and result["n"] == 1
    # the bar ends full: it counted every call the run made (reference pipeline and every method's runs)
    calls = demo_calls(get_workload("gsm8k-chain3"), 1, len(DEMO_METHODS), DemoConfig().repeats)
    assert f" {calls}/{calls} " in capsys.readouterr().err
    assert "timings on this machine" in text
    assert f"Every method ({len(PIPELINE_METHODS)})" in text and "--keep-store (the demo keeps one" in text
    assert "capped at 4 tokens" in text
    assert all(len(c) for c in result["calls"])
    table = text[text.index("where the time went"):].splitlines()
    stages = {line.rsplit(None, 2)[0]: float(line.rsplit(None, 2)[1]) for line in table[2:] if "%" in line}
    assert stages["install (make: venv + pip)"] == 5.0
    assert {f"method {m}" for m in DEMO_METHODS} <= set(stages)
    assert "reference pipeline (full, every agent's output)" in stages
    assert all(s >= 0 for s in stages.values())
    assert (tmp_path / "gsm8k-chain3-agent-ttft-by-agent.png").exists()
