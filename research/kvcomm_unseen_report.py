"""Markdown tables for the KVCOMM unseen-subject runs: per method, reuse, fallbacks by reason, fidelity, speed.

Usage: python research/kvcomm_unseen_report.py RESULT.json [...]

A fallback reason is what `kvcomm`'s gate wrote for the call (every failing placeholder, "; "-joined):
- "length": a placeholder has anchors, but fewer than `warmup` at least as long as it;
- "pool": the placeholder's pool itself holds fewer than `warmup` anchors (a cold pool);
- "entropy": the gate's softmax over the anchors' L2 distances is not decisive (normalized entropy > gamma);
- "other": anything else (e.g. a span missing from the store).
A call that misses on two reasons counts once under each, and once in "calls".
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import Counter

from kvrelay.eval.report import is_near_tie

_ANCHOR_COUNT = re.compile(r"has (\d+) of (\d+) anchors(?: >= \d+ tokens)? \((\d+) pooled\)")


def reasons(fallback: str | None) -> set[str]:
    """The reasons a call fell back for (empty: it reused)."""
    if fallback is None:
        return set()
    out = set()
    for part in re.split(r"; (?=placeholder|span|dense)", fallback.removeprefix("kvcomm: ")):
        if "anchor entropy" in part:
            out.add("entropy")
        elif m := _ANCHOR_COUNT.search(part):
            out.add("pool" if int(m.group(3)) < int(m.group(2)) else "length")
        elif not part.startswith("dense prefill"):
            out.add("other")
    return out or {"other"}


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def _f(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def table(data: dict) -> str:
    calls = data["calls"]
    env = data["env"]
    warm = data.get("warm_problem_ids") or []
    subjects = sorted({c["problem_id"].rsplit("-", 1)[0].removeprefix("mmlu-") for c in calls})
    warm_subjects = sorted({w.rsplit("-", 1)[0].removeprefix("mmlu-") for w in warm})
    overlap = set(subjects) & set(warm_subjects)
    lines = [f"**{data['workload']}**, {data['model']}, {data['n']} problems ({len(subjects)} subjects) after "
             f"{len(warm)} unrecorded warm-up problems ({len(warm_subjects)} other subjects; shared: "
             f"{len(overlap)}); commit {env['commit']}, {env['machine']}, {env['device']}", "",
             "| method | reuse/call | reuse/token | fallback: length / pool / entropy / other (calls) | "
             "1st-token agree (all / clear / reused) | KL(full‖m) (all / reused) | greedy@32 | speedup vs full | "
             "ideal | share of ideal | calls |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for method, s in data["results"].items():
        rows = [c for c in calls if c["method"] == method]
        why = Counter(r for c in rows for r in reasons(c["fallback"]))
        num_fallback = sum(c["fallback"] is not None for c in rows)
        reused = [c for c in rows if c["fallback"] is None and c["reused_token_layers"] > 0]
        clear = [c for c in rows if not is_near_tie(c["full_first_margin"])]
        agree = _f(s["first_token_agreement"], ".2f")
        agree_clear = _f(_mean([float(c["first_token_agree"]) for c in clear]), ".2f")
        agree_reused = _f(_mean([float(c["first_token_agree"]) for c in reused]), ".2f")
        kl_reused = _f(_mean([c["kl_first_token"] for c in reused]), ".4f")
        ideal = s["ideal_speedup"]
        share = s["speedup_vs_full"] / ideal if ideal else None
        fb = (f"{why['length']} / {why['pool']} / {why['entropy']} / {why['other']} ({num_fallback})"
              if method not in ("full", "prefix") else "–")
        lines.append(
            f"| {method} | {s['reuse_rate_per_call']:.2f} | {s['reuse_rate']:.3f} | {fb} | {agree} / {agree_clear} / "
            f"{agree_reused} | {_f(s['kl_first_token'], '.4f')} / {kl_reused} | {_f(s['greedy_match_rate'], '.2f')} | "
            f"{s['speedup_vs_full']:.2f}× | {_f(ideal, '.2f')}× | {_f(share, '.2f')} | {s['n_calls']} "
            f"({len(reused)} reused) |")
    near_tie = next((s.get("near_tie_rate") for s in data["results"].values() if s.get("near_tie_rate") is not None),
                    None)
    if near_tie is not None:
        lines.append(f"\n\"clear\": the {1 - near_tie:.0%} of calls whose `full` first token leads its second by "
                     "at least 0.02 in probability.")
    return "\n".join(lines)


def main(paths: list[str]) -> None:
    for path in paths:
        with open(path, encoding="utf-8") as f:
            print(table(json.load(f)) + f"\n\n(`{path}`)\n")


if __name__ == "__main__":
    main(sys.argv[1:])
