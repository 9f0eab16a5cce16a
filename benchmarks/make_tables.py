"""Markdown tables for BENCHMARKS.md, read from benchmarks/results/*.json (no number typed by hand).

Usage: python benchmarks/make_tables.py > /tmp/tables.md
"""

from __future__ import annotations

import json
from pathlib import Path

from kvrelay.eval.stats import mean, median

RESULTS = Path(__file__).parent / "results"


def _f(v, spec: str, suffix: str = "") -> str:
    return "–" if v is None else format(v, spec) + suffix


def _caption(d: dict, path: Path) -> str:
    env = d["env"]
    return (f"**{d['workload']}** ({d['mode']} mode, {d['n']} problems, {d['model']}, {env['device']}; "
            f"`{path.name}`, commit {env['commit']}, {env['machine']})")


def bench_table(path: Path) -> str:
    d = json.loads(path.read_text())
    lines = [_caption(d, path), "",
             "| method | TTFT ms (median) | speedup vs full | vs prefix | ideal | reuse | recompute | "
             "1st-token agree | KL(full‖m) | greedy@32 | accuracy | calls |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m, s in d["results"].items():
        lines.append(f"| {m} | {_f(s['ttft_ms_median'], '.1f')} | {_f(s['speedup_vs_full'], '.2f', '×')} | "
                     f"{_f(s['speedup_vs_prefix'], '.2f', '×')} | {_f(s['ideal_speedup'], '.2f', '×')} | "
                     f"{_f(s['reuse_rate'], '.3f')} | {_f(s['recompute_frac'], '.3f')} | "
                     f"{_f(s['first_token_agreement'], '.2f')} | {_f(s['kl_first_token'], '.3f')} | "
                     f"{_f(s['greedy_match_rate'], '.2f')} | {_f(s['accuracy'], '.2f')} | {s['n_calls']} |")
    return "\n".join(lines)


def copy_agents_table() -> str:
    methods = ("prefix", "naive", "cacheblend", "epic", "relay")
    rows = ["| agents | last agent prompt tokens | full TTFT ms | " + " | ".join(methods) + " | ideal speedup | "
            "1st-token agreement (all calls): " + " / ".join(methods) + " |", "|---:|" * 1 + "---:|" * 9]
    for a in (2, 3, 4, 5):
        path = RESULTS / f"copy-agents-{a}.json"
        if not path.exists():
            continue
        res = json.loads(path.read_text())["results"]
        last = max(res["full"]["by_agent"].values(), key=lambda b: b["position"])
        name = next(k for k, v in res["full"]["by_agent"].items() if v is last)
        cells = [f"{res[m]['by_agent'][name]['speedup_vs_full']:.2f}×" if m in res else "–" for m in methods]
        agree = " / ".join(_f(res[m]["first_token_agreement"], ".2f") if m in res else "–" for m in methods)
        rows.append(f"| {a} | {last['num_prompt_tokens_median']:.0f} | {last['ttft_ms_median']:.0f} | "
                    + " | ".join(cells) + f" | {last['ideal_speedup']:.2f}× | {agree} |")
    return "\n".join(rows)


def _or_none(stat, values: list[float]) -> float | None:
    return stat(values) if values else None


def kvcomm_table(path: Path) -> str:
    """Per method: reuse per call and per token, fallbacks, and fidelity/speed over all calls and over
    the calls that reused (a fallback is a full prefill, exact by construction)."""
    d = json.loads(path.read_text())
    lines = [_caption(d, path), "",
             "| method | reuse/call | reuse/token | fallback | speedup vs full (all / reused calls) | ideal | "
             "1st-token agree (all / reused) | greedy@32 (all / reused) | KL(full‖m) | accuracy | calls |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m, s in d["results"].items():
        calls = [c for c in d["calls"] if c["method"] == m]
        reused = [c for c in calls if c["reused_token_layers"] > 0]
        sp = _or_none(median, [c["full_ttft_ms"] / c["ttft_ms"] for c in reused])
        agree = _or_none(mean, [float(c["first_token_agree"]) for c in reused if c["first_token_agree"] is not None])
        greedy = _or_none(mean, [float(c["greedy_match"]) for c in reused if c["greedy_match"] is not None])
        lines.append(
            f"| {m} | {_f(s['reuse_rate_per_call'], '.2f')} | {_f(s['reuse_rate'], '.3f')} | "
            f"{_f(s['fallback_rate'], '.2f')} | {_f(s['speedup_vs_full'], '.2f', '×')} / {_f(sp, '.2f', '×')} | "
            f"{_f(s['ideal_speedup'], '.2f', '×')} | {_f(s['first_token_agreement'], '.2f')} / {_f(agree, '.2f')} | "
            f"{_f(s['greedy_match_rate'], '.2f')} / {_f(greedy, '.2f')} | {_f(s['kl_first_token'], '.3f')} | "
            f"{_f(s['accuracy'], '.2f')} | {s['n_calls']} ({len(reused)} reused) |")
    return "\n".join(lines)


def kvcomm_copy_agents_table() -> str:
    """Last agent's TTFT speedup over full: kvcomm (median over all its calls and over reused ones) and relay."""
    rows = ["| agents | last agent prompt tokens | full TTFT ms | relay | kvcomm (all calls) | kvcomm (reused calls) | "
            "kvcomm reused / calls | ideal | 1st-token agree relay / kvcomm |", "|---:|" + "---:|" * 8]
    for a in (2, 3, 4, 5):
        path = RESULTS / f"kvcomm-copy-agents-{a}.json"
        if not path.exists():
            continue
        d = json.loads(path.read_text())
        res = d["results"]
        last = max(res["full"]["by_agent"], key=lambda k: res["full"]["by_agent"][k]["position"])
        kv = next(m for m in res if m.startswith("kvcomm"))
        calls = [c for c in d["calls"] if c["method"] == kv and c["agent"] == last]
        reused = [c for c in calls if c["reused_token_layers"] > 0]
        sp = _or_none(median, [c["full_ttft_ms"] / c["ttft_ms"] for c in reused])
        b = res["full"]["by_agent"][last]
        rows.append(f"| {a} | {b['num_prompt_tokens_median']:.0f} | {b['ttft_ms_median']:.0f} | "
                    f"{res['relay']['by_agent'][last]['speedup_vs_full']:.2f}× | "
                    f"{res[kv]['by_agent'][last]['speedup_vs_full']:.2f}× | {_f(sp, '.2f', '×')} | "
                    f"{len(reused)} / {len(calls)} | {b['ideal_speedup']:.2f}× | "
                    f"{_f(res['relay']['first_token_agreement'], '.2f')} / "
                    f"{_f(res[kv]['first_token_agreement'], '.2f')} |")
    return "\n".join(rows)


def engine_table() -> str:
    d = json.loads((RESULTS / "engine_cpu.json").read_text())
    p, dec, load = d["prefill"], d["decode"], d["load"]
    return "\n".join([
        f"`engine_cpu.json`, commit {d['env']['commit']}, {d['env']['machine']}, torch {d['env']['torch']}", "",
        "| what | ours | transformers | ratio (ours / transformers) | target |", "|---|---:|---:|---:|---|",
        f"| prefill {p['prompt_tokens']} tokens, ms (median) | {p['ours_ms_median']:.0f} | "
        f"{p['transformers_ms_median']:.0f} | {p['ratio_ours_over_transformers']:.3f} | ≤ 1.1 |",
        f"| decode, tokens/s (median) | {dec['ours_tokens_per_s_median']:.1f} | "
        f"{dec['transformers_tokens_per_s_median']:.1f} | {dec['ratio_ours_over_transformers']:.3f} | ≥ 1.0 |",
        f"| second load of smollm2-135m, s (fresh process) | {load['second_load_s_median']:.1f} | – | – | < 10 s |",
        f"| max abs logit difference (1,024-token prefill, fp32) | {p['max_abs_logit_diff']:.1e} | | | |",
    ])


if __name__ == "__main__":
    print("## Engine\n\n" + engine_table() + "\n")
    for name in ("gsm8k-chain3", "humaneval-adr", "gsm8k-fc3", "mmlu-fc3", "humaneval-fc3", "gsm8k-chain3-e2e",
                 "sweep-gsm8k-chain3"):
        path = RESULTS / f"{name}.json"
        if path.exists():
            print(bench_table(path) + "\n")
    print("## copy-agents: last agent's TTFT speedup over full\n\n" + copy_agents_table() + "\n")
    print("## KVCOMM\n")
    for name in ("kvcomm-gsm8k-fc3", "kvcomm-mmlu-fc3", "kvcomm-humaneval-fc3", "kvcomm-gsm8k-fc3-e2e"):
        path = RESULTS / f"{name}.json"
        if path.exists():
            print(kvcomm_table(path) + "\n")
    print("### copy-agents: last agent's TTFT speedup over full, kvcomm and relay\n\n" + kvcomm_copy_agents_table())
