"""The HTTP run of ``serve_chain.py`` beside the in-process bench on the same problems.

    python benchmarks/serve_compare.py benchmarks/results/serve-chain.json

In-process rows come from the committed 50-problem runs (``gsm8k-chain3-lane0.json``; relay with
the shipped profile from ``gsm8k-chain3-relay-s5.json``), restricted to the HTTP run's problems.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SOURCES = {"relay": "gsm8k-chain3-relay-s5.json"}
DEFAULT_SOURCE = "gsm8k-chain3-lane0.json"


def in_process(method: str, problems: set[str]) -> dict | None:
    calls = json.loads((RESULTS / SOURCES.get(method, DEFAULT_SOURCE)).read_text())["calls"]
    rows = [c for c in calls if c["method"] == method and c["problem_id"] in problems]
    if not rows:
        return None
    return {"n_calls": len(rows),
            "reuse_rate": sum(r["reused_token_layers"] for r in rows) / sum(r["prompt_token_layers"] for r in rows),
            "first_token_agreement": statistics.mean(r["first_token_agree"] for r in rows),
            "greedy_match_rate": statistics.mean(r["greedy_match"] for r in rows),
            "speedup_vs_full": statistics.median(r["full_ttft_ms"] / r["ttft_ms"] for r in rows)}


def main() -> None:
    http = json.loads(Path(sys.argv[1]).read_text())
    problems = {c["problem_id"] for c in http["calls"]}
    print("| method | where | calls | reuse | first-token | greedy@32 | speedup vs full |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for method, s in http["results"].items():
        for where, row in (("HTTP", s), ("in-process", in_process(method, problems))):
            if row is None:
                continue
            print(f"| {method} | {where} | {row['n_calls']} | {row['reuse_rate']:.3f} | "
                  f"{row['first_token_agreement']:.2f} | {row['greedy_match_rate']:.2f} | "
                  f"{row['speedup_vs_full']:.2f}x |")


if __name__ == "__main__":
    main()
