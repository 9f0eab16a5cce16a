"""Two methods on the same downstream calls, paired call by call, from bench JSONs (lanes of one or more runs).

    python research/paired_calls.py --a relay --a-files NEW-lane0.json NEW-lane25.json \
        --b epic --b-files OLD-combined.json [--json OUT.json]

Reuse (token-layers, summed over the calls) and mean first-token KL as ratios of B's, first-token agreement
and greedy@32 shares, the calls only one method matches greedily with the exact two-sided sign test's p over
them, and greedy@32 per agent. Rows pair on (problem, agent); runs of different files must agree on each
call's prompt (its token count) and, where both hold ``full``'s row, on full's first-token margin, since both
methods are held to ``full`` on the same prompt ids.
"""

from __future__ import annotations

import argparse
import json
from math import comb
from pathlib import Path

from kvrelay.eval.result_files import read_json


def load_rows(paths: list[str], method: str, required: bool = True) -> dict[tuple[str, str], dict]:
    """(problem, agent) -> the method's row in these files; one row per call (a repeat or a file given twice
    is refused, not silently overwritten). None at all: an exit when ``required``, else empty."""
    rows = {}
    for path in paths:
        for r in read_json(path)["calls"]:
            if r["method"] == method:
                key = (r["problem_id"], r["agent"])
                if key in rows:
                    raise SystemExit(f"{path}: a second {method!r} row for {key} (repeats, or a file given twice)")
                rows[key] = r
    if not rows and required:
        raise SystemExit(f"no rows of method {method!r} in {', '.join(paths)}")
    return rows


def check_full_rows(a_full: dict[tuple[str, str], dict], b_full: dict[tuple[str, str], dict]) -> int:
    """The calls both runs hold a ``full`` row for must agree on full's first-token margin (the same prompt
    through the same model); returns how many were compared."""
    shared = sorted(set(a_full) & set(b_full))
    differ = [k for k in shared if a_full[k]["full_first_margin"] != b_full[k]["full_first_margin"]]
    if differ:
        raise SystemExit(f"full's first token differs between the runs on {len(differ)} calls, e.g. {differ[0]}")
    return len(shared)


def sign_test_p(only_a: int, only_b: int) -> float:
    """Exact two-sided binomial p of a split this uneven among the discordant calls, at even odds."""
    n = only_a + only_b
    if not n:
        return 1.0
    tail = sum(comb(n, i) for i in range(min(only_a, only_b) + 1)) / 2**n
    return min(1.0, 2 * tail)


def summary(rows: dict[tuple[str, str], dict], keys: list[tuple[str, str]]) -> dict[str, float]:
    token_layers = sum(rows[k]["prompt_token_layers"] for k in keys)
    return {"reuse": sum(rows[k]["reused_token_layers"] for k in keys) / token_layers,
            "kl": sum(rows[k]["kl_first_token"] for k in keys) / len(keys),
            "first_token": sum(rows[k]["first_token_agree"] for k in keys) / len(keys),
            "greedy": sum(rows[k]["greedy_match"] for k in keys) / len(keys)}


def pair(a: dict[tuple[str, str], dict], b: dict[tuple[str, str], dict]) -> dict:
    keys = sorted(set(a) & set(b))
    if not keys:
        raise SystemExit("the two methods share no call")
    mismatched = [k for k in keys if a[k]["num_prompt_tokens"] != b[k]["num_prompt_tokens"]]
    if mismatched:
        raise SystemExit(f"{len(mismatched)} calls have other prompts in the two runs, e.g. {mismatched[0]}")
    sa, sb = summary(a, keys), summary(b, keys)
    only_a = sum(1 for k in keys if a[k]["greedy_match"] and not b[k]["greedy_match"])
    only_b = sum(1 for k in keys if b[k]["greedy_match"] and not a[k]["greedy_match"])
    agents = sorted({k[1] for k in keys})
    return {"calls": len(keys), "unpaired": len(set(a) ^ set(b)), "a": sa, "b": sb,
            "reuse_ratio": sa["reuse"] / sb["reuse"], "kl_ratio": sa["kl"] / sb["kl"] if sb["kl"] else None,
            "greedy_only_a": only_a, "greedy_only_b": only_b, "sign_test_p": sign_test_p(only_a, only_b),
            "greedy_by_agent": {ag: [sum(a[k]["greedy_match"] for k in keys if k[1] == ag),
                                     sum(b[k]["greedy_match"] for k in keys if k[1] == ag),
                                     sum(k[1] == ag for k in keys)] for ag in agents}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, help="method A's name in its files (e.g. relay)")
    ap.add_argument("--a-files", nargs="+", required=True)
    ap.add_argument("--b", required=True, help="method B's name in its files (e.g. epic)")
    ap.add_argument("--b-files", nargs="+", required=True)
    ap.add_argument("--json", help="write the result here too")
    args = ap.parse_args()
    out = pair(load_rows(args.a_files, args.a), load_rows(args.b_files, args.b))
    # a side without full rows: prompts are checked by their length only
    out["full_rows_checked"] = check_full_rows(load_rows(args.a_files, "full", required=False),
                                               load_rows(args.b_files, "full", required=False))
    out.update(a_method=args.a, a_files=args.a_files, b_method=args.b, b_files=args.b_files)
    a, b = out["a"], out["b"]
    print(f"{out['calls']} calls paired ({out['unpaired']} unpaired; full's rows agree on "
          f"{out['full_rows_checked']} calls both runs hold)")
    for name, s in ((args.a, a), (args.b, b)):
        print(f"  {name:12s} reuse {s['reuse']:.4f}  KL {s['kl']:.4f}  1st token {s['first_token']:.3f}  "
              f"greedy@32 {s['greedy']:.3f}")
    kl = f"{out['kl_ratio']:.2f}x" if out["kl_ratio"] is not None else "n/a"
    print(f"  {args.a} / {args.b}: reuse {out['reuse_ratio']:.4f}x, first-token KL {kl}; greedy only {args.a} "
          f"{out['greedy_only_a']}, only {args.b} {out['greedy_only_b']} (sign test p = {out['sign_test_p']:.3f})")
    for agent, (ga, gb, n) in out["greedy_by_agent"].items():
        print(f"  {agent:12s} greedy@32 {ga} against {gb} of {n}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
