"""benchmarks/behaviour_snapshot.py: a snapshot is deterministic, and the comparison flags every kind of change."""

from __future__ import annotations

import copy
import json

import behaviour_snapshot as snap
import pytest


def _row(**changes) -> dict:
    row = {"model": "m", "workload": "w", "problem_id": "p0", "agent": "critic", "position": 1, "method": "relay",
           "num_prompt_tokens": 100, "num_reused_tokens": 60, "num_computed_token_layers": 1200,
           "num_reused_token_layers": 1800, "num_recomputed_token_layers": 400, "num_shifted_tokens": 60,
           "reuse_rate": 0.6, "fallback": None, "note": None, "exit_layer": None, "first_token_id": 7,
           "first_token_agree": True, "kl_first_token": 0.02, "greedy_ids": [7, 8, 9, 10], "greedy_match": True}
    row.update(changes)
    return row


def test_identical_rows_and_kl_within_rounding_pass():
    table, problems = snap.compare_rows([_row()], [_row(kl_first_token=0.02 * (1 + 1e-4))])
    assert problems == []
    assert table["relay"]["kl_first_token"]["calls_differing"] == 1
    assert table["relay"]["kl_first_token"]["max_diff"] == pytest.approx(2e-6)


@pytest.mark.parametrize("changes", [
    {"greedy_ids": [7, 8, 9, 11]}, {"first_token_id": 8}, {"num_reused_tokens": 59},
    {"num_recomputed_token_layers": 401}, {"fallback": "no span"}, {"note": "3 tokens from layer 0"},
    {"kl_first_token": 0.021}, {"reuse_rate": 0.61}, {"first_token_agree": False}])
def test_each_kind_of_change_is_past_tolerance(changes):
    table, problems = snap.compare_rows([_row()], [_row(**changes)])
    (name,) = changes
    assert len(problems) == 1 and name in problems[0]
    assert table["relay"][name]["calls_differing"] == 1


def test_only_the_problems_both_ran_are_compared():
    _, problems = snap.compare_rows([_row(), _row(problem_id="p1")], [_row()])
    assert problems == []
    _, problems = snap.compare_rows([_row(), _row(problem_id="p1")], [_row(), _row(problem_id="p1", note="x")])
    assert len(problems) == 1


def test_greedy_difference_counts_tokens_from_the_first_that_differs():
    assert snap.field_difference("greedy_ids", [1, 2, 3, 4], [1, 2, 5, 4]) == 2
    assert snap.field_difference("greedy_ids", [1, 2, 3, 4], [1, 2]) == 2


def test_a_call_in_one_snapshot_only_is_a_problem():
    _, problems = snap.compare_rows([_row(), _row(agent="finalizer")], [_row()])
    assert len(problems) == 1 and "finalizer" in problems[0]


def test_two_records_of_the_same_code_compare_equal_and_a_changed_token_fails(tmp_path, capsys):
    args = ["--models", "random:tiny", "--workloads", "gsm8k-chain3", "--limit", "1", "--greedy-tokens", "4",
            "--max-upstream-tokens", "8", "--methods", "full,naive,epic[k=2],kvcomm"]
    first, second, changed = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    assert snap.main(["--out", str(first), *args]) == 0
    assert snap.main(["--out", str(second), *args]) == 0
    data = json.loads(first.read_text())
    assert {r["method"] for r in data["calls"]} == {"full", "naive", "epic[k=2]", "kvcomm"}
    assert data["num_problems"] == 1 and all(len(r["greedy_ids"]) <= 4 for r in data["calls"])
    assert snap.main(["--compare", str(first), str(second)]) == 0
    edited = copy.deepcopy(data)
    edited["calls"][-1]["greedy_ids"][-1] += 1
    changed.write_text(json.dumps(edited))
    capsys.readouterr()
    assert snap.main(["--compare", str(first), str(changed)]) == 1
    assert "greedy_ids" in capsys.readouterr().out
