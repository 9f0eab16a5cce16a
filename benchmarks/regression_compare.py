"""Compare two bench JSONs call by call: reuse counts and fidelity must agree (the restructure check).

    python benchmarks/regression_compare.py BEFORE.json AFTER.json [--out OUT.md]

Per method: calls compared, calls whose token-layer counts differ, calls whose first token differs,
and the largest difference of first-token KL and greedy match. Timing is not compared (noisy).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

from kvrelay.closed_pipe import run_main

COUNTS = ("num_prompt_tokens", "prompt_token_layers", "reused_token_layers", "reused_span_token_layers",
          "recomputed_token_layers")


def _calls(path: str) -> dict[tuple, dict]:
    rows = json.load(open(path))["calls"]
    return {(r["problem_id"], r["agent"], r["method"]): r for r in rows}


def compare(before: dict[tuple, dict], after: dict[tuple, dict]) -> list[dict]:
    per_method: dict[str, dict] = defaultdict(lambda: {"calls": 0, "count_diffs": 0, "first_token_diffs": 0,
                                                       "max_kl_diff": 0.0, "max_greedy_diff": 0.0})
    if set(before) != set(after):
        raise SystemExit(f"the runs hold different calls: {sorted(set(before) ^ set(after))[:5]} ...")
    for key, b in before.items():
        a, m = after[key], per_method[key[2]]
        m["calls"] += 1
        m["count_diffs"] += any(a[c] != b[c] for c in COUNTS if c in b)
        m["first_token_diffs"] += a["first_token_agree"] != b["first_token_agree"]
        m["max_kl_diff"] = max(m["max_kl_diff"], abs(a["kl_first_token"] - b["kl_first_token"]))
        m["max_greedy_diff"] = max(m["max_greedy_diff"], abs(a["greedy_match"] - b["greedy_match"]))
    return [{"method": k, **v} for k, v in per_method.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--out", default=None, help="write the markdown table here too")
    args = parser.parse_args(argv)
    rows = compare(_calls(args.before), _calls(args.after))
    lines = ["| method | calls | calls with other token-layer counts | first token differs | max abs ΔKL | "
             "max abs Δgreedy@32 |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['calls']} | {r['count_diffs']} | {r['first_token_diffs']} | "
              f"{r['max_kl_diff']:.2e} | {r['max_greedy_diff']:.3f} |" for r in rows]
    text = "\n".join(lines)
    print(text)
    if args.out:
        open(args.out, "w").write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))  # a reader that goes away (| head) ends it quietly
