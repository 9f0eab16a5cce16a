"""kvrelay bench end to end on a tiny model: the JSON contract, and exactness of full and prefix."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from kvrelay.errors import ConfigError
from kvrelay.eval.harness import Bench, BenchConfig
from kvrelay.eval.report import NEAR_TIE_MARGIN
from kvrelay.eval.stats import median_ratio
from kvrelay.pipeline.spec import AgentSpec, PipelineSpec
from kvrelay.pipeline.workloads import Problem

CONTRACT_KEYS = {"ttft_ms_median", "speedup_vs_full", "speedup_vs_prefix", "ideal_speedup", "reuse_rate",
                 "recompute_frac", "first_token_agreement", "greedy_match_rate", "kl_first_token", "accuracy",
                 "n_calls"}


def test_bench_cli_writes_the_json_contract(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "kvrelay", "bench", "--workload", "gsm8k-chain3",
                           "--methods", "full,prefix", "--limit", "2", "--model", "random:tiny", "--repeats", "1",
                           "--json", str(out), "--plot", str(tmp_path / "plots")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "not meaningful" in proc.stdout
    data = json.loads(out.read_text())
    assert set(data["env"]) >= {"machine", "device", "torch", "kvrelay", "commit"}
    assert data["model"] == "random:tiny" and data["workload"] == "gsm8k-chain3" and data["n"] == 2
    assert set(data["results"]) == {"full", "prefix"}
    for s in data["results"].values():
        assert set(s) >= CONTRACT_KEYS
        assert s["n_calls"] == 4  # 2 problems x (critic, finalizer)
        assert s["accuracy"] is None  # agent mode: no end-to-end score
    # the summary is the per-call rows' numbers: pooled reuse, median of per-call TTFT ratios against full
    for method, s in data["results"].items():
        rows = [c for c in data["calls"] if c["method"] == method]
        assert len(rows) == 4
        reused = sum(c["reused_token_layers"] for c in rows) / sum(c["prompt_token_layers"] for c in rows)
        assert s["reuse_rate"] == pytest.approx(reused)
        assert s["speedup_vs_full"] == pytest.approx(median_ratio([c["full_ttft_ms"] for c in rows],
                                                                  [c["ttft_ms"] for c in rows]))
    assert data["results"]["full"]["reuse_rate"] == 0.0  # full loads nothing
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["gsm8k-chain3-agent-ttft-by-agent.png"]


def test_prefix_is_exact_where_it_reuses():
    """copy-agents: every agent's prompt starts with the same system prompt + context, so prefix reuses."""
    bench = Bench(BenchConfig(workload="copy-agents:3", methods=("full", "prefix", "naive"), limit=1,
                              model="random:tiny", repeats=1, greedy_tokens=8))
    result = bench.run(progress=False)
    r = result["results"]
    assert r["prefix"]["reuse_rate"] > 0.3
    # full's first-token margin: one number per call, the same on every method's row, counted as a near-tie or not
    margins = {}
    for c in result["calls"]:
        assert 0.0 <= c["full_first_margin"] <= 1.0
        assert margins.setdefault((c["problem_id"], c["agent"]), c["full_first_margin"]) == c["full_first_margin"]
    near = sum(m < NEAR_TIE_MARGIN for m in margins.values()) / len(margins)
    assert r["prefix"]["near_tie_rate"] == pytest.approx(near)
    # prefix reuses the exact prefix only: the same first token, the same greedy text, no KL; naive also
    # reuses earlier agents' outputs in a new context, which the fidelity columns must see
    assert r["prefix"]["first_token_agreement"] == 1.0
    assert r["prefix"]["greedy_match_rate"] == 1.0
    assert r["prefix"]["kl_first_token"] < 1e-6
    assert r["prefix"]["recompute_frac"] == 0.0
    assert r["naive"]["reuse_rate"] > r["prefix"]["reuse_rate"]
    # random weights give near-uniform first tokens, so naive's KL is small, but a harness that compared a
    # method with itself (or full with full) would give exactly 0 on every call
    assert max(c["kl_first_token"] for c in result["calls"] if c["method"] == "naive") > 0.0


def test_offset_and_checkpoints():
    """--offset picks later problems (lanes); the checkpoint sees the result after each problem but the last."""
    seen = []
    bench = Bench(BenchConfig(workload="gsm8k-chain3", methods=("full", "naive"), limit=2, offset=3,
                              model="random:tiny", repeats=1, greedy_tokens=2))
    result = bench.run(progress=False, checkpoint=seen.append)
    assert [r["n"] for r in seen] == [1] and result["n"] == 2
    assert sorted({c["problem_id"] for c in seen[0]["calls"]}) == ["gsm8k-3"]
    assert sorted({c["problem_id"] for c in result["calls"]}) == ["gsm8k-3", "gsm8k-4"]
    assert result["results"]["naive"]["n_calls"] == 4 and seen[0]["results"]["naive"]["n_calls"] == 2
    with pytest.raises(ConfigError, match="offset must be >= 0"):
        BenchConfig(offset=-1)


def test_e2e_mode_scores_the_final_answer_with_the_workload_scorer():
    """The final agent's output is forced to "... Answer: 42": the GSM8K scorer must find one problem right
    (reference 42) and one wrong (reference 41), for every method."""
    spec = PipelineSpec("forced-chain", ("question",), (
        AgentSpec("solver", user="{question}", max_new_tokens=4),
        AgentSpec("finalizer", user="{question}\n{solver}\nFinal answer?", forced_output="So it is 40 + 2. Answer: 42"),
    ))
    problems = [Problem({"question": "What is 40 + 2?"}, "42", "right"),
                Problem({"question": "What is 40 + 1?"}, "41", "wrong")]
    bench = Bench(BenchConfig(workload="gsm8k-chain3", methods=("full", "prefix"), limit=2, model="random:tiny",
                              mode="e2e"))
    bench.workload = replace(bench.workload, spec=spec, problems=lambda path, limit: problems[:limit])
    r = bench.run(progress=False)["results"]
    assert r["full"]["accuracy"] == 0.5 and r["prefix"]["accuracy"] == 0.5
    assert r["full"]["first_token_agreement"] is None  # fidelity is an agent-mode measure


def test_bad_bench_config():
    with pytest.raises(ConfigError, match="unknown method"):
        BenchConfig(methods=("magic",))
    with pytest.raises(ConfigError, match="unknown workload"):
        Bench(BenchConfig(workload="nope", model="random:tiny"))
    with pytest.raises(ConfigError, match="no task score"):
        Bench(BenchConfig(workload="copy-agents", methods=("full", "prefix"), model="random:tiny", mode="e2e",
                          limit=1)).run(progress=False)


def test_warm_problems_fill_kvcomm_pools_before_measuring():
    """copy-agents repeats its template: one warm-up problem gives kvcomm[warmup=1] an anchor per placeholder,
    so the measured problem reuses on every downstream call, where a cold run falls back on its first ones."""
    def run(warm: int) -> dict:
        cfg = BenchConfig(workload="copy-agents:3", methods=("kvcomm[warmup=1,gamma=1]",), limit=1,
                          model="random:tiny", repeats=1, greedy_tokens=2, warm_problems=warm)
        return Bench(cfg).run(progress=False)

    cold, warm = run(0), run(1)
    assert cold["warm_problem_ids"] == [] and warm["warm_problem_ids"] == ["copy-1"]  # after the measured one
    assert {c["problem_id"] for c in warm["calls"]} == {"copy-0"}  # the warm-up is not recorded
    name = "kvcomm[warmup=1,gamma=1]"
    assert cold["results"][name]["fallback_rate"] > 0
    assert warm["results"][name]["fallback_rate"] == 0.0
    assert warm["results"][name]["n_calls"] == cold["results"][name]["n_calls"]


def test_bad_warm_up():
    with pytest.raises(ConfigError, match="warm_problems must be >= 0"):
        BenchConfig(warm_problems=-1)
    with pytest.raises(ConfigError, match="warm_data is given"):
        BenchConfig(warm_data="x.jsonl")
    with pytest.raises(ConfigError, match="nothing to warm"):  # refused by the config, before a model loads
        BenchConfig(workload="copy-agents:2", methods=("naive", "relay"), limit=1, warm_problems=1)
    assert BenchConfig(methods=("naive", "kvcomm"), warm_problems=1).warm_problems == 1  # kvcomm keeps state
    with pytest.raises(ConfigError, match="only 1 problems exist"):
        Bench(BenchConfig(workload="gsm8k-chain3", methods=("kvcomm",), limit=1, offset=998, model="random:tiny",
                          warm_problems=5)).run(progress=False)


def test_the_json_records_what_relay_resolved_from_the_model():
    bench = Bench(BenchConfig(workload="gsm8k-chain3", methods=("full", "naive", "relay[band=1:2:3]"),
                              limit=1, model="random:tiny", repeats=1, greedy_tokens=4))
    result = bench.run(progress=False)
    settings = result["method_settings"]
    assert set(settings) == {"relay[band=1:2:3]"}  # full and naive resolve nothing
    relay = settings["relay[band=1:2:3]"]
    assert relay["layers"] == [1, 2, 3]
    assert relay["selector"]["tau_dev"] == 1.5 and relay["selector"]["end_tokens"] == 10  # no profile: the paper's
    json.dumps(result)  # it goes into the bench's JSON as it is


def test_the_commit_says_when_the_code_was_edited(tmp_path):
    """A result's env.commit is the code it ran: ``-dirty`` after an edit to tracked code, not after a rewritten
    result file (a run_all.sh step rewrites those before the next one starts)."""
    from kvrelay.eval.harness import checkout_commit

    repo = tmp_path / "repo"
    (repo / "kvrelay").mkdir(parents=True)
    (repo / "benchmarks" / "results").mkdir(parents=True)
    code, result = repo / "kvrelay" / "m.py", repo / "benchmarks" / "results" / "r.json"
    code.write_text("x = 1\n")
    result.write_text("{}\n")

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                              capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "c")
    head = git("rev-parse", "--short", "HEAD")
    assert checkout_commit(repo / "kvrelay") == head
    result.write_text('{"n": 1}\n')
    (repo / "notes.txt").write_text("untracked\n")
    assert checkout_commit(repo / "kvrelay") == head
    code.write_text("x = 2\n")
    assert checkout_commit(repo / "kvrelay") == f"{head}-dirty"
    outside = tmp_path / "outside"
    outside.mkdir()
    assert checkout_commit(outside) is None
