"""research/paired_calls.py: two methods' bench rows paired call by call (ratios, discordant greedy calls and
the exact sign test), on hand-made rows."""

import json

import pytest
from paired_calls import check_full_rows, load_rows, pair, sign_test_p


def _row(problem: str, agent: str, method: str, reused: int, kl: float, greedy: bool, prompt: int = 10,
         first: bool = True) -> dict:
    return {"problem_id": problem, "agent": agent, "method": method, "num_prompt_tokens": prompt,
            "prompt_token_layers": 10 * prompt, "reused_token_layers": reused, "kl_first_token": kl,
            "first_token_agree": first, "greedy_match": greedy, "full_first_margin": 0.1 * prompt}


def test_sign_test_p_is_the_exact_two_sided_binomial():
    assert sign_test_p(0, 0) == 1.0
    assert sign_test_p(3, 3) == 1.0
    assert sign_test_p(0, 5) == pytest.approx(2 / 32)  # 2 * P(X <= 0), X ~ Bin(5, 1/2)
    assert sign_test_p(1, 4) == pytest.approx(2 * 6 / 32)
    assert sign_test_p(15, 22) == pytest.approx(sign_test_p(22, 15))


def test_pair_counts_calls_each_method_alone_matches_and_the_ratios(tmp_path):
    a = [_row("p0", "critic", "relay", 70, 0.002, True), _row("p0", "finalizer", "relay", 50, 0.004, False),
         _row("p1", "critic", "relay", 60, 0.000, True, prompt=20, first=False),
         _row("p1", "finalizer", "relay", 80, 0.0, True), _row("p8", "critic", "relay", 60, 0.0, True)]
    b = [_row("p0", "critic", "epic", 60, 0.010, False), _row("p0", "finalizer", "epic", 60, 0.002, True),
         _row("p1", "critic", "epic", 60, 0.006, False, prompt=20), _row("p1", "finalizer", "epic", 60, 0.0, True),
         _row("p9", "critic", "epic", 60, 0.0, True)]
    (tmp_path / "a.json").write_text(json.dumps({"calls": a + [_row("p0", "critic", "full", 0, 0.0, True)]}))
    (tmp_path / "b.json").write_text(json.dumps({"calls": b}))
    out = pair(load_rows([str(tmp_path / "a.json")], "relay"), load_rows([str(tmp_path / "b.json")], "epic"))
    assert out["calls"] == 4 and out["unpaired"] == 2  # p8 only in a, p9 only in b
    # token-layers summed over the calls (p1's critic has 200 of the 500), not a mean of per-call shares
    assert out["a"]["reuse"] == pytest.approx(260 / 500) and out["b"]["reuse"] == pytest.approx(240 / 500)
    assert out["reuse_ratio"] == pytest.approx(260 / 240)
    assert out["a"]["kl"] == pytest.approx(0.006 / 4) and out["b"]["kl"] == pytest.approx(0.018 / 4)
    assert out["kl_ratio"] == pytest.approx(0.006 / 0.018)
    assert out["a"]["first_token"] == pytest.approx(3 / 4) and out["b"]["first_token"] == 1.0
    assert out["a"]["greedy"] == pytest.approx(3 / 4) and out["b"]["greedy"] == pytest.approx(2 / 4)
    assert (out["greedy_only_a"], out["greedy_only_b"]) == (2, 1)
    assert out["sign_test_p"] == pytest.approx(1.0)
    assert out["greedy_by_agent"] == {"critic": [2, 0, 2], "finalizer": [1, 2, 2]}


def test_a_second_row_for_a_call_is_refused(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"calls": [_row("p0", "critic", "relay", 70, 0.0, True)]}))
    assert len(load_rows([str(tmp_path / "a.json")], "relay")) == 1
    with pytest.raises(SystemExit, match="second 'relay' row"):
        load_rows([str(tmp_path / "a.json")] * 2, "relay")


def test_full_rows_of_the_two_runs_must_agree():
    a = {(p, "critic"): _row(p, "critic", "full", 0, 0.0, True) for p in ("p0", "p1")}
    b = {("p0", "critic"): _row("p0", "critic", "full", 0, 0.0, True)}
    assert check_full_rows(a, b) == 1
    b[("p0", "critic")]["full_first_margin"] = 0.5
    with pytest.raises(SystemExit, match="differs between the runs"):
        check_full_rows(a, b)


def test_pair_refuses_calls_with_other_prompts():
    a = {("p0", "critic"): _row("p0", "critic", "relay", 70, 0.0, True, prompt=10)}
    b = {("p0", "critic"): _row("p0", "critic", "epic", 60, 0.0, True, prompt=11)}
    with pytest.raises(SystemExit, match="other prompts"):
        pair(a, b)
