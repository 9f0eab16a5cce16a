"""Where first-token disagreements sit: agreement with ``full`` by full's own first-token margin, from bench JSONs.

    python research/first_token_margins.py --methods relay epic --files LANE0.json LANE25.json [--json OUT.json]

Full's margin is the probability of its top-1 first token minus its top-2's (``full_first_margin``). Where it is
tiny any method's error decides the argmax, and the first-token share can only be met by errors smaller than
those gaps. Per method and margin bin: calls, agreements, mean first-token KL; then how many disagreements the
issue's 0.95 bar allows on these calls, how many fall in the bins under 0.01, and the agreement on clear calls (not
near-ties, as the bench reports it).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from paired_calls import load_rows

from kvrelay.eval.report import is_near_tie

BIN_EDGES = (0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 1.0)
TARGET_SHARE = 0.95  # issue 23's first-token agreement


def by_margin(rows: list[dict]) -> list[dict]:
    """Per bin [lo, hi) of full's margin (the last bin closed): calls, agreements, mean KL."""
    bins = []
    for i, (lo, hi) in enumerate(zip(BIN_EDGES, BIN_EDGES[1:], strict=False)):
        last = i == len(BIN_EDGES) - 2
        sel = [r for r in rows if lo <= r["full_first_margin"] < hi or (last and r["full_first_margin"] == hi)]
        bins.append({"lo": lo, "hi": hi, "calls": len(sel), "agree": sum(r["first_token_agree"] for r in sel),
                     "mean_kl": sum(r["kl_first_token"] for r in sel) / len(sel) if sel else None})
    return bins


def summarize(rows: list[dict]) -> dict:
    """One method's rows: agreements, misses, the misses the target allows on these calls, those among the calls
    whose margin is under 0.01, and the bins."""
    bins = by_margin(rows)
    misses = len(rows) - sum(r["first_token_agree"] for r in rows)
    tiny = [b for b in bins if b["hi"] <= 0.01]
    clear = [r for r in rows if not is_near_tie(r["full_first_margin"])]
    return {"calls": len(rows), "agree": len(rows) - misses, "misses": misses,
            "clear_calls": len(clear), "clear_agree": sum(r["first_token_agree"] for r in clear),
            # misses that leave agreement >= the target: n - ceil(target x n) (rounded first: 0.95 x 600 is 570)
            "misses_allowed_at_target": len(rows) - math.ceil(round(TARGET_SHARE * len(rows), 9)),
            "calls_under_0.01": sum(b["calls"] for b in tiny),
            "misses_under_0.01": sum(b["calls"] - b["agree"] for b in tiny), "bins": bins}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", required=True, help="method names as the files hold them (a spec may hold "
                    "commas, so they are separate arguments)")
    ap.add_argument("--files", nargs="+", required=True, help="bench JSONs (lanes)")
    ap.add_argument("--json", help="where to write the table")
    args = ap.parse_args()
    out = {"files": args.files, "bin_edges": BIN_EDGES, "methods": {}}
    for method in args.methods:
        s = out["methods"][method] = summarize(list(load_rows(args.files, method).values()))
        print(f"{method}: {s['agree']}/{s['calls']} agree; {s['misses']} misses, {s['misses_allowed_at_target']} "
              f"allowed at {TARGET_SHARE}; {s['misses_under_0.01']} of them among the {s['calls_under_0.01']} calls "
              f"with margin < 0.01; clear calls {s['clear_agree']}/{s['clear_calls']}")
        for b in s["bins"]:
            if b["calls"]:
                print(f"  margin [{b['lo']}, {b['hi']}): {b['agree']}/{b['calls']} agree, mean KL {b['mean_kl']:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
