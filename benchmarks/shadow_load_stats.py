"""benchmarks/quality_shadow_load.py's pure helpers: percentiles, the ABAB plan and the pairing of its phases, the
``/metrics`` diff, each role's call count, and the summaries of a phase's calls (TTFT, decode rate); and the shadow
pacer's replay over recorded calls (benchmarks/shadow_pacer_replay.py). No server."""

from __future__ import annotations

import math
import statistics

import numpy as np
from prometheus_client.parser import text_string_to_metric_families


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) with linear interpolation between order statistics (numpy's default); nan if empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(values: list[float]) -> dict:
    return {"num": len(values), "p50": percentile(values, 0.5), "p90": percentile(values, 0.9),
            "mean": statistics.mean(values) if values else float("nan")}


def phase_plan(arms: tuple[str, ...], num_repeats: int) -> list[tuple[str, int]]:
    """Arms alternated within each repeat (A B A B ...): (arm, repeat) per phase, in run order."""
    return [(arm, repeat) for repeat in range(num_repeats) for arm in arms]


def compare_arms(phases: list[dict], key: str = "ttft_ms_p50", on: str = "on", off: str = "off") -> dict:
    """The on/off ratio of ``key`` per repeat (phases paired by repeat) and of the arms' means over repeats; the
    noise: per arm, the relative spread of ``key`` over its repeats ((max - min) / mean). ``within_noise``: the
    ratio's distance from 1 is at most the larger arm's spread (needs two repeats of each arm)."""
    by_arm: dict[str, dict[int, float]] = {}
    for p in phases:
        by_arm.setdefault(p["arm"], {})[p["repeat"]] = p[key]
    if on not in by_arm or off not in by_arm:
        raise ValueError(f"phases of both arms {on!r} and {off!r} are needed, got {sorted(by_arm)}")
    paired = sorted(set(by_arm[on]) & set(by_arm[off]))
    spread = {arm: (max(v.values()) - min(v.values())) / statistics.mean(v.values()) if len(v) > 1 else None
              for arm, v in by_arm.items()}
    ratio = statistics.mean(by_arm[on].values()) / statistics.mean(by_arm[off].values())
    noise = [s for s in spread.values() if s is not None]
    return {"key": key, "ratio_per_repeat": {r: by_arm[on][r] / by_arm[off][r] for r in paired},
            "ratio": ratio, "spread": spread, "noise": max(noise) if noise else None,
            "within_noise": abs(ratio - 1) <= max(noise) if noise else None}


def metric_values(text: str) -> dict[str, float]:
    """Prometheus exposition text as {sample name with its labels: value} (``name{a="x"}``; bare name without)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def metrics_delta(before: dict[str, float], after: dict[str, float], names: tuple[str, ...]) -> dict[str, float]:
    """``after - before`` of each of ``names`` (a sample missing before counts from 0; missing after: absent)."""
    return {n: after[n] - before.get(n, 0.0) for n in names if n in after}


def with_call_index(calls: list[dict], key: str | tuple[str, ...] = "agent") -> list[dict]:
    """The calls, each with ``call_index``: its rank (from 0) among the calls of its ``key`` (a field, or a tuple of
    fields) by send time (``sent_s``), the count the guard keeps per role (one role per agent in a namespace; with
    a namespace per chain, per (client, chain, agent))."""
    out, seen = [], {}
    for c in sorted(calls, key=lambda c: c["sent_s"]):
        role = tuple(c[k] for k in key) if isinstance(key, tuple) else c[key]
        seen[role] = seen.get(role, -1) + 1
        out.append({**c, "call_index": seen[role]})
    return out


CALL_KEY = ("client", "chain", "agent")


def common_calls(phase_calls: list[list[dict]], key: tuple[str, ...] = CALL_KEY) -> list[list[dict]]:
    """Each phase's calls kept to those every phase completed (by ``key``): the phases compare the same requests
    when a phase stopped early (its deadline) or lost a call to an error."""
    keys = [{tuple(c[k] for k in key) for c in calls} for calls in phase_calls]
    shared = set.intersection(*keys) if keys else set()
    return [[c for c in calls if tuple(c[k] for k in key) in shared] for calls in phase_calls]


def ttft_summary(calls: list[dict], num_first: int) -> dict:
    """TTFT p50/p90 over ``calls`` (with ``call_index``), over each role's first ``num_first`` calls (all shadowed
    with the guard on) and over the calls after; engine TTFT, queue wait and request time beside them."""
    first = [c["ttft_ms"] for c in calls if c["call_index"] < num_first]
    after = [c["ttft_ms"] for c in calls if c["call_index"] >= num_first]
    ttft = [c["ttft_ms"] for c in calls]
    return {"num_calls": len(calls), "ttft_ms_p50": percentile(ttft, 0.5), "ttft_ms_p90": percentile(ttft, 0.9),
            "ttft_ms_first_calls_p50": percentile(first, 0.5), "ttft_ms_after_first_calls_p50": percentile(after, 0.5),
            "ttft_ms": summarize(ttft), "ttft_ms_first_calls": summarize(first),
            "ttft_ms_after_first_calls": summarize(after), "total_ms": summarize([c["total_ms"] for c in calls]),
            "total_ms_p50": percentile([c["total_ms"] for c in calls], 0.5),
            "engine_ttft_ms": summarize([c["engine_ttft_ms"] for c in calls if c["engine_ttft_ms"] is not None]),
            "queue_ms": summarize([c["queue_ms"] for c in calls if c["queue_ms"] is not None]),
            "by_agent": {a: summarize([c["ttft_ms"] for c in calls if c["agent"] == a])
                         for a in dict.fromkeys(c["agent"] for c in calls)},
            "methods_after_first_calls": {m: sum(c["method"] == m for c in calls if c["call_index"] >= num_first)
                                          for m in sorted({str(c["method"]) for c in calls})},
            "cached_tokens_mean": statistics.mean(c["cached_tokens"] or 0 for c in calls) if calls else None,
            **decode_summary(calls)}


def decode_summary(calls: list[dict]) -> dict:
    """Decode rate (tokens/s after the first) over the calls that have one, and TTFT of the downstream agents (every
    agent after a chain's first, ``step`` > 0: the calls that reuse upstream KV and arrive right after an upstream
    answer; none in a report from before rows had a step)."""
    rates = [c["decode_tokens_per_s"] for c in calls if c.get("decode_tokens_per_s")]
    downstream = [c["ttft_ms"] for c in calls if c.get("step")]
    return {"decode_tokens_per_s_p50": percentile(rates, 0.5), "decode_tokens_per_s": summarize(rates),
            "downstream_ttft_ms_p50": percentile(downstream, 0.5), "downstream_ttft_ms": summarize(downstream)}


def decode_rate(num_tokens: int | None, first_s: float | None, end_s: float) -> float | None:
    """Tokens after the first per second after the first (None: fewer than two tokens, or no first token)."""
    if not num_tokens or num_tokens < 2 or first_s is None or end_s <= first_s:
        return None
    return (num_tokens - 1) / (end_s - first_s)


# ------------------------------------------------------------------------------------------------ the pacer replay
def call_live_ms(call: dict) -> tuple[float, float]:
    """A recorded call's live engine time: its prefill (engine TTFT less its queue wait) and its decode (the time
    from its first token to its end, which one client's call has to itself)."""
    prefill_ms = call["engine_ttft_ms"] - (call["queue_ms"] or 0.0)
    return prefill_ms, max(0.0, call["total_ms"] - call["ttft_ms"])


def fit_prefill_coef(calls: list[dict], chunk_tokens: int) -> tuple[float, float, float]:
    """The chunk budget's (fixed per piece, per token, per attended key) in ms, fitted to the recorded calls that
    reused nothing (their engine TTFT is a whole prefill, in pieces of ``chunk_tokens``): non-negative least squares
    of relative error, as the budget fits its pieces (each subset of terms, the best feasible one)."""
    rows = [c for c in calls if not c["cached_tokens"] and c["prompt_tokens"]]
    if not rows:
        raise ValueError("no recorded call without cached tokens to fit")
    n = np.array([c["prompt_tokens"] for c in rows], dtype=float)
    ms = np.array([call_live_ms(c)[0] for c in rows])
    design = np.stack([np.ceil(n / chunk_tokens), n, n * (n + 1) / 2], axis=1) / ms[:, None]  # relative error
    best, best_err = None, math.inf
    for terms in ((1,), (0, 1), (1, 2), (0, 1, 2)):
        sol, *_ = np.linalg.lstsq(design[:, terms], np.ones(len(rows)), rcond=None)
        err = float(np.sum((design[:, terms] @ sol - 1.0) ** 2))
        if np.all(sol >= 0) and err < best_err * (1 - 1e-9):
            coef = [0.0, 0.0, 0.0]
            for term, value in zip(terms, sol, strict=True):
                coef[term] = float(value)
            best, best_err = tuple(coef), err
    if best is None:
        raise ValueError("no non-negative fit")
    return best


def replay_pacer(calls: list[dict], pacer, cost_ms, affordable) -> dict:
    """The calls, in send order, through ``pacer`` (a ``ShadowPacer`` on an injected clock): each call's prefill
    earns, then it is offered at its first token (``affordable(pacer, cost, prefill_ms)``: taken and charged
    ``cost_ms(call)``),
    then its decode earns. Every call is offered (a tenant that salts each conversation: every call its role's
    first) and a reference takes its predicted time. Whether each call was shadowed, and the shadows' share of the
    live time."""
    taken, shadow_ms, live_ms = [], 0.0, 0.0
    for call in sorted(calls, key=lambda c: c["sent_s"]):
        prefill_ms, decode_ms = call_live_ms(call)
        pacer.live_turn(prefill_ms)
        cost = cost_ms(call)
        taken.append(bool(affordable(pacer, cost, prefill_ms)))
        if taken[-1]:
            pacer.take(cost)
            shadow_ms += cost
        pacer.live_turn(decode_ms)
        live_ms += prefill_ms + decode_ms
    return {"taken": taken, "num_shadowed": sum(taken), "shadow_ms": shadow_ms, "live_ms": live_ms,
            "shadow_share_of_live": shadow_ms / live_ms if live_ms else float("nan")}


def shadowed_by_quartile(num_tokens: list[int], taken: list[bool], edges: list[float] | None = None) -> dict:
    """Calls and shadowed calls per prompt-length quartile (edges: the 25/50/75th percentiles of ``num_tokens``
    unless given; a length on an edge falls in the lower quartile)."""
    edges = [percentile(num_tokens, q) for q in (0.25, 0.5, 0.75)] if edges is None else edges
    quartiles = [{"num_calls": 0, "num_shadowed": 0} for _ in range(4)]
    for n, t in zip(num_tokens, taken, strict=True):
        q = quartiles[sum(n > e for e in edges)]
        q["num_calls"] += 1
        q["num_shadowed"] += bool(t)
    for q in quartiles:
        q["share_shadowed"] = q["num_shadowed"] / q["num_calls"] if q["num_calls"] else None
    return {"edges_tokens": edges, "quartiles": quartiles}
