"""bench --keep-store: one store across problems, so every method reuses the cross-request exact prefix."""

from kvrelay.eval.harness import Bench, BenchConfig


def _run(keep: bool) -> dict:
    cfg = BenchConfig(workload="gsm8k-chain3", methods=("full", "prefix", "naive"), limit=2, model="random:tiny",
                      repeats=1, greedy_tokens=1, keep_store=keep)
    return Bench(cfg).run(progress=False)


def test_a_kept_store_adds_the_exact_prefix_of_earlier_problems():
    fresh, kept = _run(False), _run(True)
    rows = {(k, r["problem_id"], r["agent"], r["method"]): r for k, res in (("fresh", fresh), ("kept", kept))
            for r in res["calls"]}
    problems = sorted({r["problem_id"] for r in fresh["calls"]})
    for agent in ("critic", "finalizer"):
        first, second = (rows[("kept", p, agent, "prefix")] for p in problems)
        # the first problem finds nothing the fresh store does not have; the second finds the agent's own
        # system prompt (and template head) stored by the first problem's call of the same agent
        assert first["reused_token_layers"] == rows[("fresh", problems[0], agent, "prefix")]["reused_token_layers"]
        assert second["reused_token_layers"] > rows[("fresh", problems[1], agent, "prefix")]["reused_token_layers"]
        naive_fresh = rows[("fresh", problems[1], agent, "naive")]
        naive_kept = rows[("kept", problems[1], agent, "naive")]
        assert naive_kept["reused_token_layers"] > naive_fresh["reused_token_layers"]
        assert naive_kept["num_new_tokens"] < naive_fresh["num_new_tokens"]  # the ideal counts the prefix too
