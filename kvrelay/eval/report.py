"""Per-call rows -> the bench summary, a printed table, and the JSON contract (docs/benchmarks.md).

Pure Python: the harness turns tensors into numbers before they reach here.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass

from kvrelay.eval.stats import mean, median, median_ratio

# `full`'s top-1 first-token probability leads its top-2 by less than this: a near-tie. On SmolLM2-135M
# 20 of the 100 gsm8k-chain3 downstream calls start this way ("The" 0.127 vs "To" 0.117), and any
# approximate KV flips such a call's first token at random; the bench reports agreement on the other
# calls beside the plain one.
NEAR_TIE_MARGIN = 0.02


def is_near_tie(margin: float) -> bool:
    """``margin``: `full`'s top-1 minus top-2 first-token probability (fidelity.first_token_margin)."""
    return margin < NEAR_TIE_MARGIN


@dataclass
class CallRow:
    """One method on one downstream call (a call that can reuse something)."""

    problem_id: str
    agent: str
    position: int  # the agent's index in run order
    method: str
    num_prompt_tokens: int
    num_new_tokens: int  # not covered by any reusable span (what an ideal method computes)
    ttft_ms: float
    full_ttft_ms: float  # `full` on the same call, same run
    prefix_ttft_ms: float | None  # `prefix` on the same call (None if not measured)
    ideal_ttft_ms: float | None  # a prefill of the new tokens only
    prompt_token_layers: int
    reused_token_layers: int
    reused_span_token_layers: int  # token-layers of reused spans (recompute_frac's denominator)
    recomputed_token_layers: int
    first_token_agree: bool | None = None  # None where fidelity was not measured (e2e mode)
    kl_first_token: float | None = None
    greedy_match: bool | None = None
    fallback: str | None = None
    full_first_margin: float | None = None  # `full`'s top-1 minus top-2 first-token probability (None: unknown)


def _near_tie_stats(fidelity: list[CallRow]) -> tuple[float | None, float | None]:
    """(share of calls whose `full` first token is a near-tie, first-token agreement on the other calls);
    None where the rows carry no margin (results from before it was recorded)."""
    if not fidelity or any(r.full_first_margin is None for r in fidelity):
        return None, None
    clear = [r for r in fidelity if not is_near_tie(r.full_first_margin)]
    near_tie_rate = 1 - len(clear) / len(fidelity)
    return near_tie_rate, (mean([float(r.first_token_agree) for r in clear]) if clear else None)


def summarize(rows: list[CallRow], accuracy: dict[str, float] | None = None) -> dict[str, dict]:
    """Per method, the summary over its downstream calls (docs/benchmarks.md lists its fields)."""
    by_method: dict[str, list[CallRow]] = defaultdict(list)
    for r in rows:
        by_method[r.method].append(r)
    out = {}
    for method, rs in by_method.items():
        span_tl = sum(r.reused_span_token_layers for r in rs)
        prefix_pairs = [(r.prefix_ttft_ms, r.ttft_ms) for r in rs if r.prefix_ttft_ms is not None]
        ideal_pairs = [(r.full_ttft_ms, r.ideal_ttft_ms) for r in rs if r.ideal_ttft_ms is not None]
        fidelity = [r for r in rs if r.first_token_agree is not None]
        near_tie_rate, clear_agreement = _near_tie_stats(fidelity)
        summary = {
            "ttft_ms_median": median([r.ttft_ms for r in rs]),
            "speedup_vs_full": median_ratio([r.full_ttft_ms for r in rs], [r.ttft_ms for r in rs]),
            "speedup_vs_prefix": median_ratio(*zip(*prefix_pairs, strict=True)) if prefix_pairs else None,
            "ideal_speedup": median_ratio(*zip(*ideal_pairs, strict=True)) if ideal_pairs else None,
            "reuse_rate": sum(r.reused_token_layers for r in rs) / sum(r.prompt_token_layers for r in rs),
            "recompute_frac": sum(r.recomputed_token_layers for r in rs) / span_tl if span_tl else 0.0,
            "first_token_agreement": mean([float(r.first_token_agree) for r in fidelity]) if fidelity else None,
            "greedy_match_rate": mean([float(r.greedy_match) for r in fidelity]) if fidelity else None,
            "kl_first_token": mean([r.kl_first_token for r in fidelity]) if fidelity else None,
            # calls where full's first token leads by < NEAR_TIE_MARGIN, and agreement on all the others
            "near_tie_rate": near_tie_rate,
            "first_token_agreement_clear": clear_agreement,
            "accuracy": (accuracy or {}).get(method),
            "n_calls": len(rs),
            "fallback_rate": sum(r.fallback is not None for r in rs) / len(rs),
            # calls the method itself reused on: a fallback that loaded only the exact prefix does not count
            "reuse_rate_per_call": mean([float(r.reused_token_layers > 0 and r.fallback is None) for r in rs]),
            "by_agent": {},
        }
        for agent in dict.fromkeys(r.agent for r in rs):
            ar = [r for r in rs if r.agent == agent]
            summary["by_agent"][agent] = {
                "position": ar[0].position, "n_calls": len(ar),
                "ttft_ms_median": median([r.ttft_ms for r in ar]),
                "speedup_vs_full": median_ratio([r.full_ttft_ms for r in ar], [r.ttft_ms for r in ar]),
                "ideal_speedup": median_ratio([r.full_ttft_ms for r in ar], [r.ideal_ttft_ms for r in ar])
                if all(r.ideal_ttft_ms for r in ar) else None,
                "num_prompt_tokens_median": statistics.median(r.num_prompt_tokens for r in ar),
            }
        out[method] = summary
    return out


def _fmt(value, spec: str, meaningful: bool = True) -> str:
    if value is None:
        return "-"
    if not meaningful:
        return "n/a"
    return format(value, spec)


def format_table(results: dict[str, dict], fidelity_meaningful: bool = True, greedy_tokens: int | None = None) -> str:
    """The per-method table; ``greedy_tokens``: G of greedy@G, named in its header where given."""
    width = max(10, *(len(m) for m in results))
    row = f"{{:<{width}}}" + " {:>9} {:>8} {:>9} {:>7} {:>6} {:>9} {:>8} {:>7} {:>9} {:>9} {:>8} {:>5} {:>5}"
    cols = ("method", "TTFT ms", "vs full", "vs prefix", "ideal", "reuse", "recompute", "fallback", "1st-tok",
            "1st-clear", "KL", f"greedy@{greedy_tokens or 'G'}", "acc", "calls")
    lines = [row.format(*cols)]
    lines.append("-" * len(lines[0]))
    for method, s in results.items():
        lines.append(row.format(
            method, _fmt(s["ttft_ms_median"], ".1f"), _fmt(s["speedup_vs_full"], ".2f") + "x",
            _fmt(s["speedup_vs_prefix"], ".2f") + ("x" if s["speedup_vs_prefix"] else ""),
            _fmt(s["ideal_speedup"], ".2f") + ("x" if s["ideal_speedup"] else ""),
            _fmt(s["reuse_rate"], ".3f"), _fmt(s["recompute_frac"], ".3f"), _fmt(s.get("fallback_rate"), ".2f"),
            _fmt(s["first_token_agreement"], ".2f", fidelity_meaningful),
            _fmt(s.get("first_token_agreement_clear"), ".2f", fidelity_meaningful),
            _fmt(s["kl_first_token"], ".1e", fidelity_meaningful),
            _fmt(s["greedy_match_rate"], ".2f", fidelity_meaningful),
            _fmt(s["accuracy"], ".2f"), s["n_calls"]))
    # the units a reader would otherwise guess at: token-layers, not tokens (a served call's cached_tokens are tokens)
    lines.append("TTFT ms: median over calls; vs full, vs prefix: median per-call ratios; ideal: full's TTFT over a "
                 "prefill of only the new tokens")
    lines.append("reuse: share of the prompt's token-layers taken from the cache; recompute: share of the reused "
                 "spans' token-layers computed again")
    near_tie = next((s.get("near_tie_rate") for s in results.values() if s.get("near_tie_rate") is not None), None)
    if near_tie is not None and fidelity_meaningful:
        lines.append(f"1st-clear: first-token agreement on the calls whose `full` first token leads by >= "
                     f"{NEAR_TIE_MARGIN} in probability ({1 - near_tie:.0%} of calls; the rest are near-ties)")
    return "\n".join(lines)


def format_by_agent(results: dict[str, dict]) -> str:
    agents = list(next(iter(results.values()))["by_agent"])
    head = f"{'TTFT ms by agent':<18}" + "".join(f"{a:>14}" for a in agents)
    lines = [head, "-" * len(head)]
    for method, s in results.items():
        cells = []
        for a in agents:
            b = s["by_agent"].get(a)
            cells.append(f"{b['ttft_ms_median']:>8.1f} ({b['speedup_vs_full']:.1f}x)" if b else f"{'-':>14}")
        lines.append(f"{method:<18}" + "".join(f"{c:>14}" for c in cells))
    return "\n".join(lines)


def merge_results(results: list[dict]) -> dict:
    """Bench results of one run split into lanes (``--offset``) -> one result, re-summarized from the
    per-call rows (e2e accuracy: the lanes' accuracies weighted by their numbers of problems). Lanes
    must share workload, model, mode and methods and hold disjoint problems. (Stateful methods such as
    KVCOMM start each lane with an empty pool: a merged run is not the same as one long run for them.)"""
    if not results:
        raise ValueError("merge_results: no results to merge")
    first = results[0]
    key = ("workload", "model", "mode")
    for r in results[1:]:
        for k in key:
            if r[k] != first[k]:
                raise ValueError(f"merge_results: lanes differ in {k}: {first[k]!r} vs {r[k]!r}")
        if list(r["results"]) != list(first["results"]):
            raise ValueError(f"merge_results: lanes ran different methods: {list(first['results'])} vs "
                             f"{list(r['results'])}")
    rows: list[CallRow] = []
    seen: dict[str, int] = {}
    for lane, r in enumerate(results):
        for problem_id in dict.fromkeys(c["problem_id"] for c in r["calls"]):
            if seen.setdefault(problem_id, lane) != lane:
                raise ValueError(f"merge_results: problem {problem_id!r} is in lanes {seen[problem_id]} and {lane}")
        rows.extend(CallRow(**c) for c in r["calls"])
    accuracy = None
    if first["mode"] == "e2e":  # each lane's accuracy is a mean over its problems: weight it by their number
        num_problems = sum(r["n"] for r in results)
        accuracy = {m: sum(r["results"][m]["accuracy"] * r["n"] for r in results) / num_problems
                    for m in first["results"]}
    merged = summarize(rows, accuracy)
    peak = max(s.get("peak_store_bytes", 0) for r in results for s in r["results"].values())
    for s in merged.values():
        s["peak_store_bytes"] = peak
    return {**first, "n": sum(r["n"] for r in results), "results": merged, "calls": rows_to_json(rows),
            "lanes": [{"n": r["n"], "config": r.get("config"), "env": r.get("env")} for r in results]}


def rows_to_json(rows: list[CallRow]) -> list[dict]:
    return [asdict(r) for r in rows]


def format_time_split(stages: list[tuple[str, float]]) -> str:
    """Where the time went: one line per (stage, seconds), its share of the total, and the total."""
    total_s = sum(s for _, s in stages)
    width = max(len("where the time went"), *(len(name) for name, _ in stages))
    lines = [f"{'where the time went':<{width}} {'s':>7} {'share':>6}", "-" * (width + 15)]
    for name, seconds in stages:
        lines.append(f"{name:<{width}} {seconds:>7.1f} {seconds / total_s if total_s else 0:>6.0%}")
    lines.append(f"{'total':<{width}} {total_s:>7.1f}")
    return "\n".join(lines)
