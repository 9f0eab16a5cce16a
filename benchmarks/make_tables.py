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
    env, warm = d["env"], d.get("warm_problem_ids") or []
    warmed = f", after {len(warm)} unrecorded warm-up problems ({warm[0]} to {warm[-1]})" if warm else ""
    return (f"**{d['workload']}** ({d['mode']} mode, {d['n']} problems{warmed}, {d['model']}, {env['device']}; "
            f"`{path.name}`, commit {env['commit']}, {env['machine']})")


def bench_table(path: Path) -> str:
    """A workload's table; where ``NAME-lane*.json`` files exist (a run split with --offset), they are merged
    from their per-call rows and replace ``NAME.json`` (and the merged run's plots are written to
    ``results/lanes/``)."""
    from kvrelay.eval.plots import write_plots
    from kvrelay.eval.report import merge_results

    lanes = sorted(path.parent.glob(f"{path.stem}-lane*.json"))
    if lanes:
        d = merge_results([json.loads(p.read_text()) for p in lanes])
        env, cfg = d["env"], d["config"]
        caption = (f"**{d['workload']}** ({d['mode']} mode, {d['n']} problems, {d['model']}, {env['device']}; lanes "
                   f"{', '.join(f'`{p.name}`' for p in lanes)} merged, run side by side at one torch thread each, "
                   f"repeats {cfg['repeats']}; commit {env['commit']}, {env['machine']})")
        write_plots(d, RESULTS / "lanes")
    else:
        d = json.loads(path.read_text())
        caption = _caption(d, path)
    lines = [caption, "",
             "| method | TTFT ms (median) | speedup vs full | vs prefix | ideal | reuse | recompute | "
             "1st-token agree | KL(full‖m) | greedy@32 | accuracy | calls |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m, s in d["results"].items():
        lines.append(f"| {m} | {_f(s['ttft_ms_median'], '.1f')} | {_f(s['speedup_vs_full'], '.2f', '×')} | "
                     f"{_f(s['speedup_vs_prefix'], '.2f', '×')} | {_f(s['ideal_speedup'], '.2f', '×')} | "
                     f"{_f(s['reuse_rate'], '.3f')} | {_f(s['recompute_frac'], '.3f')} | "
                     f"{_f(s['first_token_agreement'], '.2f')} | {_f(s['kl_first_token'], '.4f')} | "
                     f"{_f(s['greedy_match_rate'], '.2f')} | {_f(s['accuracy'], '.2f')} | {s['n_calls']} |")
    return "\n".join(lines)


def _copy_agents_runs(name: str):
    """(agents, run, last agent's name) for each ``name.format(a=agents)`` result file of copy-agents 2..5."""
    for a in (2, 3, 4, 5):
        path = RESULTS / name.format(a=a)
        if path.exists():
            d = json.loads(path.read_text())
            by_agent = d["results"]["full"]["by_agent"]
            yield a, d, max(by_agent, key=lambda k: by_agent[k]["position"])


def copy_agents_table() -> str:
    methods = ("prefix", "naive", "cacheblend", "epic", "relay")
    rows = ["| agents | last agent prompt tokens | full TTFT ms | " + " | ".join(methods) + " | ideal speedup | "
            "1st-token agreement (all calls): " + " / ".join(methods) + " |", "|---:|" * 1 + "---:|" * 9]
    for a, d, name in _copy_agents_runs("copy-agents-{a}.json"):
        res = d["results"]
        last = res["full"]["by_agent"][name]
        cells = [f"{res[m]['by_agent'][name]['speedup_vs_full']:.2f}×" if m in res else "–" for m in methods]
        agree = " / ".join(_f(res[m]["first_token_agreement"], ".2f") if m in res else "–" for m in methods)
        rows.append(f"| {a} | {last['num_prompt_tokens_median']:.0f} | {last['ttft_ms_median']:.0f} | "
                    + " | ".join(cells) + f" | {last['ideal_speedup']:.2f}× | {agree} |")
    return "\n".join(rows)


def relay_s5_table(name: str) -> str:
    """Session 5's run of ``relay`` with the fidelity-chosen profile, beside the other methods' rows of the
    earlier 50-problem lanes on the same calls (checked), marked ¹."""
    from kvrelay.eval.report import merge_results

    path = RESULTS / f"{name}-relay-s5.json"
    lanes = sorted(RESULTS.glob(f"{name}-lane*.json"))
    if not path.exists() or not lanes:
        return ""
    d = json.loads(path.read_text())
    old = merge_results([json.loads(p.read_text()) for p in lanes])
    if not _same_calls(d, old):
        raise SystemExit(f"{path.name} and {name}-lane*.json did not run the same calls")
    lines = [_caption(d, path) + f"; ¹ rows from the merged `{name}-lane*.json` (commit {old['env']['commit']}), "
             "the same calls (prompt lengths of every call checked equal), speedups against that run's own `full`; "
             "`relay ¹` there is the session-4 profile (18/27/29)", "",
             "| method | reuse | 1st-token agree | KL(full‖m) | greedy@32 | speedup vs full | ideal | "
             "speedup / ideal |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    rows = [(m, st) for m, st in d["results"].items()] + [(m + " ¹", st) for m, st in old["results"].items()
                                                          if m not in ("full", "prefix")]
    for m, st in rows:
        frac = st["speedup_vs_full"] / st["ideal_speedup"] \
            if st["speedup_vs_full"] and st["ideal_speedup"] and m not in ("full", "prefix") else None
        lines.append(f"| {m} | {_f(st['reuse_rate'], '.3f')} | {_f(st['first_token_agreement'], '.2f')} | "
                     f"{_f(st['kl_first_token'], '.4f')} | {_f(st['greedy_match_rate'], '.2f')} | "
                     f"{_f(st['speedup_vs_full'], '.2f', '×')} | {_f(st['ideal_speedup'], '.2f', '×')} | "
                     f"{_f(frac, '.2f')} |")
    return "\n".join(lines)


def relay_copy_agents_s5_table() -> str:
    """Last agent's TTFT speedup of ``relay`` (fidelity-chosen profile) over full on copy-agents, with its ideal."""
    rows = ["| agents | last agent prompt tokens | full TTFT ms | relay | ideal | relay / ideal | "
            "1st-token agree (last agent) | reuse (last agent) |", "|---:|" + "---:|" * 7]
    for a, d, last in _copy_agents_runs("copy-agents-{a}-relay-s5.json"):
        res = d["results"]
        b, r = res["full"]["by_agent"][last], res["relay"]["by_agent"][last]
        calls = [c for c in d["calls"] if c["method"] == "relay" and c["agent"] == last]
        agree = mean([float(c["first_token_agree"]) for c in calls])
        reuse = sum(c["reused_token_layers"] for c in calls) / sum(c["prompt_token_layers"] for c in calls)
        rows.append(f"| {a} | {b['num_prompt_tokens_median']:.0f} | {b['ttft_ms_median']:.0f} | "
                    f"{r['speedup_vs_full']:.2f}× | {b['ideal_speedup']:.2f}× | "
                    f"{r['speedup_vs_full'] / b['ideal_speedup']:.2f} | {agree:.2f} | {reuse:.3f} |")
    if len(rows) == 2:
        return "\n".join(rows)
    return "\n".join(rows) + f"\n\n(commit {d['env']['commit']}, {d['env']['machine']}; {d['n']} problems each)"


def near_tie_table(workload: str = "gsm8k-chain3") -> str:
    """First-token flips of each method on the 50-problem runs, split by `full`'s first-token margin
    (``near-ties-WORKLOAD.json`` from near_ties.py, joined call by call; the calls are checked to be the same)."""
    from kvrelay.eval.report import NEAR_TIE_MARGIN, is_near_tie, merge_results

    path, lanes = RESULTS / f"near-ties-{workload}.json", sorted(RESULTS.glob(f"{workload}-lane*.json"))
    if not path.exists() or not lanes:
        return ""
    nt = json.loads(path.read_text())
    margin = {(c["problem_id"], c["agent"]): c for c in nt["calls"]}
    runs = [("¹", merge_results([json.loads(p.read_text()) for p in lanes]))]
    s5 = RESULTS / f"{workload}-relay-s5.json"
    if s5.exists():
        runs.insert(0, ("", json.loads(s5.read_text())))
    num_near = sum(is_near_tie(c["margin"]) for c in nt["calls"])
    lines = [f"**{workload}**, {len(nt['calls'])} downstream calls, of which {num_near} are near-ties (`full`'s "
             f"top-1 first-token probability leads the top-2 by < {NEAR_TIE_MARGIN}; `{path.name}`, "
             f"commit {nt['env']['commit']}). "
             f"Rows: `{s5.name}` (shipped profile) and, marked ¹, the merged `{workload}-lane*.json` (session 4; "
             "`relay ¹` there is the 18/27/29 profile).", "",
             "| method | reuse | 1st-token agree | flips on near-ties | flips on clear calls | "
             "1st-token agree, clear calls | KL(full‖m) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for mark, run in runs:
        for c in run["calls"]:
            m = margin.get((c["problem_id"], c["agent"]))
            if m is None or m["num_prompt_tokens"] != c["num_prompt_tokens"]:
                raise SystemExit(f"{path.name} does not hold the call {c['problem_id']}/{c['agent']} of that run")
        for method, st in run["results"].items():
            if method in ("full", "prefix"):
                continue
            near, clear = [], []
            for c in (c for c in run["calls"] if c["method"] == method):
                (near if is_near_tie(margin[(c["problem_id"], c["agent"])]["margin"]) else clear).append(c)
            flips_near = sum(not c["first_token_agree"] for c in near)
            flips_clear = sum(not c["first_token_agree"] for c in clear)
            lines.append(f"| {method}{' ' + mark if mark else ''} | {_f(st['reuse_rate'], '.3f')} | "
                         f"{_f(st['first_token_agreement'], '.2f')} | {flips_near} / {len(near)} | "
                         f"{flips_clear} / {len(clear)} | {1 - flips_clear / len(clear):.2f} | "
                         f"{_f(st['kl_first_token'], '.4f')} |")
    return "\n".join(lines)


def relay_oracle_table(name: str = "relay-oracle-train.json") -> str:
    """Oracle token selection beside relay, epic and naive on GSM8K train (relay_oracle.py)."""
    path, d = _result_json(name)
    if d is None:
        return ""
    lines = [f"`{path.name}` ({d['workload']}, GSM8K *train* problems 0–{d['n'] - 1}, {d['n_calls']} downstream "
             f"calls, {d['near_tie_rate']:.0%} of them near-ties; commit {d['env']['commit']}, {d['env']['machine']})",
             "", "| method | reuse | 1st-token agree | KL(full‖m) |", "|---|---:|---:|---:|"]
    for m, st in d["results"].items():
        lines.append(f"| {m} | {st['reuse']:.3f} | {st['agree']:.2f} | {st['kl']:.4f} |")
    return "\n".join(lines)


def _or_none(stat, values: list[float]) -> float | None:
    return stat(values) if values else None


def _same_calls(a: dict, b: dict) -> bool:
    """Two runs saw the same calls: equal (problem, agent) -> prompt length over their ``full`` rows."""
    def key(d: dict) -> dict:
        return {(c["problem_id"], c["agent"]): c["num_prompt_tokens"] for c in d["calls"] if c["method"] == "full"}
    return key(a) == key(b)


def _clear_agreement(s: dict) -> str:
    """First-token agreement on the calls that are not near-ties, with the near-tie share ("–" for runs made
    before the bench recorded full's margin)."""
    if s.get("near_tie_rate") is None:
        return "–"
    return f"{_f(s['first_token_agreement_clear'], '.2f')} ({s['near_tie_rate']:.0%})"


def kvcomm_table(path: Path, baselines: Path | None = None) -> str:
    """Per method: reuse per call and per token, fallbacks, and fidelity/speed over all calls and over
    the calls that reused (a fallback is a full prefill, exact by construction). ``baselines``: an earlier
    run on the same calls (checked) whose naive / cacheblend / relay rows are appended, marked ¹."""
    d = json.loads(path.read_text())
    rows = [(m, s, d) for m, s in d["results"].items()]
    caption = _caption(d, path)
    margins = any(s.get("near_tie_rate") is not None for s in d["results"].values())  # recorded since session 10
    if baselines is not None and baselines.exists():
        old = json.loads(baselines.read_text())
        if not _same_calls(d, old):
            raise SystemExit(f"{baselines.name} and {path.name} did not run the same calls")
        rows += [(m + " ¹", old["results"][m], old) for m in ("naive", "cacheblend", "relay") if m in old["results"]]
        caption += (f"; ¹ rows from `{baselines.name}` (commit {old['env']['commit']}), the same calls (prompt "
                    f"lengths of every call checked equal); speedups are against that run's own `full`")
    lines = [caption, "",
             "| method | reuse/call | reuse/token | fallback | speedup vs full (all / reused calls) | ideal | "
             "1st-token agree (all / reused) | " + ("1st-token agree, clear calls (near-ties) | " if margins else "")
             + "greedy@32 (all / reused) | KL(full‖m) | accuracy | calls |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if margins else "")]
    for m, s, run in rows:
        calls = [c for c in run["calls"] if c["method"] == m.removesuffix(" ¹")]
        reused = [c for c in calls if c["reused_token_layers"] > 0]
        sp = _or_none(median, [c["full_ttft_ms"] / c["ttft_ms"] for c in reused])
        agree = _or_none(mean, [float(c["first_token_agree"]) for c in reused if c["first_token_agree"] is not None])
        greedy = _or_none(mean, [float(c["greedy_match"]) for c in reused if c["greedy_match"] is not None])
        lines.append(
            f"| {m} | {_f(s['reuse_rate_per_call'], '.2f')} | {_f(s['reuse_rate'], '.3f')} | "
            f"{_f(s['fallback_rate'], '.2f')} | {_f(s['speedup_vs_full'], '.2f', '×')} / {_f(sp, '.2f', '×')} | "
            f"{_f(s['ideal_speedup'], '.2f', '×')} | {_f(s['first_token_agreement'], '.2f')} / {_f(agree, '.2f')} | "
            + (f"{_clear_agreement(s)} | " if margins else "") +
            f"{_f(s['greedy_match_rate'], '.2f')} / {_f(greedy, '.2f')} | {_f(s['kl_first_token'], '.4f')} | "
            f"{_f(s['accuracy'], '.2f')} | {s['n_calls']} ({len(reused)} reused) |")
    return "\n".join(lines)


def kvcomm_copy_agents_table(name: str = "kvcomm-copy-agents-{a}.json") -> str:
    """Last agent's TTFT speedup over full: each kvcomm variant of the run (median over all its calls and over
    reused ones) and relay."""
    rows = ["| agents | kvcomm variant | last agent prompt tokens | full TTFT ms | relay | kvcomm (all calls) | "
            "kvcomm (reused calls) | kvcomm reused / calls | ideal | 1st-token agree relay / kvcomm |",
            "|---:|---|" + "---:|" * 8]
    for a, d, last in _copy_agents_runs(name):
        res = d["results"]
        b = res["full"]["by_agent"][last]
        for kv in (m for m in res if m.startswith("kvcomm")):
            calls = [c for c in d["calls"] if c["method"] == kv and c["agent"] == last]
            reused = [c for c in calls if c["reused_token_layers"] > 0]
            sp = _or_none(median, [c["full_ttft_ms"] / c["ttft_ms"] for c in reused])
            rows.append(f"| {a} | `{kv}` | {b['num_prompt_tokens_median']:.0f} | {b['ttft_ms_median']:.0f} | "
                        f"{res['relay']['by_agent'][last]['speedup_vs_full']:.2f}× | "
                        f"{res[kv]['by_agent'][last]['speedup_vs_full']:.2f}× | {_f(sp, '.2f', '×')} | "
                        f"{len(reused)} / {len(calls)} | {b['ideal_speedup']:.2f}× | "
                        f"{_f(res['relay']['first_token_agreement'], '.2f')} / "
                        f"{_f(res[kv]['first_token_agreement'], '.2f')} |")
    return "\n".join(rows)


def rksc_lanes(prefix: str = "rksc-gsm8k-branches") -> list[tuple[Path, dict]]:
    return [(path, json.loads(path.read_text())) for path in sorted(RESULTS.glob(f"{prefix}-*.json"))]


def rksc_tables(prefix: str = "rksc-gsm8k-branches") -> str:
    """gsm8k-branches: the lanes' problems merged and summarized again; block replays summed over lanes."""
    from kvrelay.eval.branch_bench import summarize_branches

    lanes = rksc_lanes(prefix)
    if not lanes:
        return f"(no {prefix}-*.json yet)"
    records = [r for _, d in lanes for r in d["problems"]]
    methods = tuple(lanes[0][1]["results"])
    res = summarize_branches(records, methods)
    d0 = lanes[0][1]
    cfg = d0["config"]
    caption = (f"**gsm8k-branches** ({len(records)} GSM8K test problems, B={cfg['branches']} branches x "
               f"T={cfg['branch_tokens']} tokens, {d0['model']}, {d0['env']['device']}; "
               f"{', '.join(f'`{p.name}`' for p, _ in lanes)}, commits "
               f"{', '.join(dict.fromkeys(d['env']['commit'] for _, d in lanes))}, {d0['env']['machine']}; "
               "lanes ran side by side, one torch thread each)")
    out = [caption, "",
           "| method | total ms (median) | branches ms | verify ms | speedup vs full | vs prefix | prompt tokens "
           "computed | branch KV MiB | KV / (root + own) | pick accuracy | pick = full's | branches = full's |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m, x in res.items():
        out.append(f"| {m} | {x['total_ms_median']:.0f} | {x['branch_ms_median']:.0f} | {x['verify_ms_median']:.0f} | "
                   f"{x['speedup_vs_full']:.2f}× | {x['speedup_vs_prefix']:.2f}× | {x['computed_token_share']:.2f} | "
                   f"{x['branch_kv_mb_mean']:.1f} | {x['kv_over_root_plus_own']:.2f} | {x['accuracy']:.2f} | "
                   f"{x['pick_agrees_with_full']:.2f} | {x['branches_equal_full']:.3f} |")
    out += ["", "CGEE error, two ways (never mixed): per problem = the pick differs from the same run without early "
            "exit (every branch verified at full depth); per call = an exited verification's yes/no verdict differs "
            "from full depth's.", "",
            "| method | problems | pick = no-early-exit pick | verifier skipped | pick kept when skipped | "
            "pick kept when verified | verify calls | layer exits | median exit layer | per-call error |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m, x in res.items():
        if "cgee_call_error" not in x:
            continue
        out.append(f"| {m} | {x['n_problems']} | {x['pick_agrees_without_early_exit']:.3f} | "
                   f"{x['verifier_skipped_share']:.2f} | {_f(x['pick_agrees_when_skipped'], '.2f')} | "
                   f"{_f(x['pick_agrees_when_verified'], '.2f')} | {x['verify_calls']} | {x['layer_exits']} | "
                   f"{_f(x['exit_layer_median'], '.0f')} | {_f(x['cgee_call_error'], '.3f')} |")
    out += ["", answer_agreement_table(records, methods), "", skip_threshold_table(records, methods)]
    for m in methods:
        if m not in d0.get("blocks", {}):
            continue
        rows: dict[tuple, dict] = {}
        working = sum(d["blocks"][m]["working_set_bytes"]["total_bytes"] for _, d in lanes)
        live = [d["blocks"][m]["live"] for _, d in lanes]
        for _, d in lanes:
            for r in d["blocks"][m]["replay"]:
                acc = rows.setdefault((r.get("concurrency", 1), r["budget_mb"], r["policy"]), dict.fromkeys(
                    ("num_lookup_blocks", "num_hit_blocks", "num_recomputed_tokens", "num_evicted_blocks",
                     "num_rejected_blocks"), 0))
                for k in acc:
                    acc[k] += r[k]
        out += ["", f"RSBCM vs LRU for `{m}`: its block-cache trace (lookups, inserts, attention-mass credits, pins) "
                f"replayed under budgets below the working set ({working / 2**20:.0f} MiB of distinct 16-token blocks "
                f"over the run, {working / 2**20 / len(records):.1f} MiB per problem); the live run used "
                f"{live[0]['policy']} at {live[0]['budget_mb']:.0f} MiB "
                f"(hit rate {sum(x['num_hit_blocks'] for x in live) / sum(x['num_lookup_blocks'] for x in live):.3f}).",
                "", "| problems in flight | budget MiB | policy | block hit rate | recomputed tokens | evicted "
                "blocks | rejected blocks |", "|---:|---:|---|---:|---:|---:|---:|"]
        for (conc, budget, policy), acc in sorted(rows.items()):
            out.append(f"| {conc} | {budget:.0f} | {policy} | {acc['num_hit_blocks'] / acc['num_lookup_blocks']:.3f} | "
                       f"{acc['num_recomputed_tokens']} | {acc['num_evicted_blocks']} | {acc['num_rejected_blocks']} |")
    return "\n".join(out)


def answer_agreement_table(records: list[dict], methods: tuple[str, ...]) -> str:
    """CGEE per problem, by branch and by answer: the picked branch vs the no-early-exit run's, and the
    number its text ends on vs that branch's (different branches often reach the same number)."""
    from kvrelay.eval.scoring import extract_number

    out = ["| method | problems | pick = no-early-exit pick (branch) | picked answer = no-early-exit answer |",
           "|---|---:|---:|---:|"]
    for m in methods:
        runs = [r["runs"][m] for r in records]
        if not runs or runs[0].get("ref_pick") is None:
            continue
        same_branch = [x["pick"] == x["ref_pick"] for x in runs]
        same_answer = [extract_number(x["texts"][x["pick"]]) == extract_number(x["texts"][x["ref_pick"]])
                       for x in runs]
        out.append(f"| {m} | {len(runs)} | {mean(same_branch):.3f} | {mean(same_answer):.3f} |")
    return "\n".join(out)


def skip_threshold_table(records: list[dict], methods: tuple[str, ...]) -> str:
    """CGEE (a) after the fact: for other (top, gap) thresholds, how often the verifier would be skipped and
    how often the skip's pick (most confident branch) equals the verified pick. Read from the recorded
    confidences and reference scores of the test problems, so it describes the rule; it sets no default."""
    from kvrelay.branches.rksc import decisive, pick

    m = next(m for m in methods if m not in ("full", "prefix"))
    runs = [r["runs"][m] for r in records]
    out = [f"CGEE (a) skip thresholds after the fact, `{m}` on the same {len(runs)} problems (analysis on test "
           "data: no default was set from it). Skip pick = the most confident branch; kept = it equals the pick "
           "of the verified run.", "", "| top ≥ | gap ≥ | skipped | kept when skipped | pick = verified pick (all) |",
           "|---:|---:|---:|---:|---:|"]
    for top in (0.70, 0.75, 0.80, 0.85, 0.90):
        for gap in (0.06, 0.10, 0.20):
            skip = [x for x in runs if decisive(x["confidences"], top, gap)]
            kept = [pick(None, x["confidences"]) == x["ref_pick"] for x in skip]
            out.append(f"| {top:.2f} | {gap:.2f} | {len(skip)} / {len(runs)} | "
                       f"{_f(mean(kept) if kept else None, '.2f')} | "
                       f"{(len(runs) - len(skip) + sum(kept)) / len(runs):.3f} |")
    return "\n".join(out)


def _result_json(name: str) -> tuple[Path, dict | None]:
    """A result file under benchmarks/results and its JSON (None when it has not been run yet)."""
    path = RESULTS / name
    return path, json.loads(path.read_text()) if path.exists() else None


def asks_table() -> str:
    """rksc with approximate ASKS on: the verifications that reused their branch's output K/V."""
    from kvrelay.eval.branch_bench import summarize_branches

    path, d = _result_json("rksc-asks-gsm8k-branches.json")
    if d is None:
        return f"(no {path.name} yet)"
    res = summarize_branches(d["problems"], tuple(d["results"]))
    m = next(k for k in res if k.startswith("rksc"))
    x, env = res[m], d["env"]
    return "\n".join([
        f"**gsm8k-branches, approximate ASKS** ({d['n']} problems, `{path.name}`, commit {env['commit']}, "
        f"{env['machine']})", "",
        "| method | total ms | verify ms | speedup vs full | vs prefix | prompt tokens computed | verifications "
        "reusing their branch | median gate cosine | mean abs(score − full-depth score) | verdict flips | "
        "pick = reference pick |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(f"| {k} | {r['total_ms_median']:.0f} | {r['verify_ms_median']:.0f} | {r['speedup_vs_full']:.2f}× | "
          f"{r['speedup_vs_prefix']:.2f}× | {r['computed_token_share']:.3f} | "
          + (f"{r['asks_reused_calls']} / {r['asks_reused_calls'] + r['verify_calls']} | "
             f"{r['asks_cosine_median']:.3f} | {_f(r['asks_score_abs_diff_mean'], '.4f')} | "
             f"{_f(r['asks_call_error'], '.3f')} | {r['pick_agrees_without_early_exit']:.2f} |"
             if k == m else "– | – | – | – | – |")
          for k, r in res.items()),
    ]) if x.get("asks_reused_calls") is not None else "(the ASKS run verified no problem)"


def interleaved_table(name: str = "rksc-rsbcm-interleaved.json") -> str:
    path, d = _result_json(name)
    if d is None:
        return f"(no {path.name} yet)"
    env = d["env"]
    shots = ""
    if d.get("few_shot"):
        shots = (f"every system prompt with {d['few_shot']} worked GSM8K train examples "
                 f"({'/'.join(map(str, d['system_prompt_tokens']))} tokens), {d['families']} example sets taking "
                 f"turns every {d['family_run']} problems; ")
    rows = [f"`rksc`'s block-cache trace on {d['n']} problems (`{path.name}`, commit {env['commit']}, "
            f"{env['machine']}; {shots}"
            f"{d['problem_working_set_mb_mean']:.1f} MiB of distinct blocks per problem, "
            f"{d['working_set_bytes']['total_bytes'] / 2**20:.0f} MiB over the run), replayed with several problems "
            "in flight (round-robin, one cache operation each):", "",
            "| problems in flight | budget MiB | policy | importance half-life (ops) | block hit rate | recomputed "
            "tokens | evicted blocks | rejected blocks |", "|---:|---:|---|---:|---:|---:|---:|---:|"]
    rows += [f"| {r['concurrency']} | {r['budget_mb']:.0f} | {r['policy']} | "
             f"{(r['half_life_ops'] or '–') if r['policy'] == 'rsbcm' else '–'} | {r['hit_rate']:.3f} | "
             f"{r['num_recomputed_tokens']} | {r['num_evicted_blocks']} | {r['num_rejected_blocks']} |"
             for r in d["replay"]]
    return "\n".join(rows)


def verifier_overhead_table() -> str:
    path, d = _result_json("rksc-verifier-overhead.json")
    if d is None:
        return f"(no {path.name} yet)"
    env = d["env"]
    rows = [f"One verifier prompt ({d['prompt_tokens']} tokens, root {d['root_tokens']}), median of {d['repeats']} "
            f"interleaved repeats (`{path.name}`, commit {env['commit']}, {env['machine']}):", "",
            "| variant | ms |", "|---|---:|"]
    rows += [f"| {name} | {ms:.0f} |" for name, ms in d["ms_median"].items()]
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


def relay_selection_table() -> str:
    """The relay variants tried on GSM8K train (``relay-select-train-*.json``, the same 10 problems in each
    run), one row per method; full and prefix once."""
    paths = sorted(RESULTS.glob("relay-select-train-*.json"))
    if not paths:
        return "(no relay-select-train-*.json)"
    lines = ["`gsm8k-chain3` on GSM8K **train** problems 0-9 (20 downstream calls per method), repeats 1, "
             "one torch thread; files " + ", ".join(f"`{p.name}`" for p in paths) + ":", "",
             "| method | reuse | 1st-token agree | KL(full‖m) | greedy@32 | speedup vs full | file |",
             "|---|---:|---:|---:|---:|---:|---|"]
    seen = set()
    for path in paths:
        d = json.loads(path.read_text())
        for m, st in d["results"].items():
            if m in seen:
                continue
            seen.add(m)
            lines.append(f"| {m} | {_f(st['reuse_rate'], '.3f')} | {_f(st['first_token_agreement'], '.2f')} | "
                         f"{_f(st['kl_first_token'], '.4f')} | {_f(st['greedy_match_rate'], '.2f')} | "
                         f"{_f(st['speedup_vs_full'], '.2f', '×')} | {path.name} (commit {d['env']['commit']}) |")
    return "\n".join(lines)


def print_kvcomm_tables(suffix: str) -> None:
    """The kvcomm runs named ``kvcomm-WORKLOAD{suffix}.json``, each with the session-2 baselines of the same calls."""
    for name in ("kvcomm-gsm8k-fc3", "kvcomm-mmlu-fc3", "kvcomm-humaneval-fc3", "kvcomm-gsm8k-fc3-e2e"):
        path = RESULTS / f"{name}{suffix}.json"
        if path.exists():
            print(kvcomm_table(path, None if name.endswith("e2e") else RESULTS / f"{name}.json") + "\n")


if __name__ == "__main__":
    print("## Engine\n\n" + engine_table() + "\n")
    for name in ("gsm8k-chain3", "humaneval-adr", "gsm8k-fc3", "mmlu-fc3", "humaneval-fc3", "gsm8k-chain3-e2e",
                 "sweep-gsm8k-chain3"):
        path = RESULTS / f"{name}.json"
        if path.exists() or list(RESULTS.glob(f"{name}-lane*.json")):
            print(bench_table(path) + "\n")
    print("### relay with the profile chosen by fidelity (session 5)\n")
    for name in ("gsm8k-chain3", "humaneval-adr"):
        table = relay_s5_table(name)
        if table:
            print(table + "\n")
    print("copy-agents, last agent:\n\n" + relay_copy_agents_s5_table() + "\n")
    table = near_tie_table("gsm8k-chain3")
    if table:
        print("### First-token flips on near-ties and on clear calls (session 10)\n\n" + table + "\n")
    table = relay_oracle_table()
    if table:
        print("### Oracle token selection on GSM8K train (session 10)\n\n" + table + "\n")
    print("### relay variants tried on GSM8K train (how the two in the 50-problem runs were chosen)\n\n"
          + relay_selection_table() + "\n")
    print("## copy-agents: last agent's TTFT speedup over full\n\n" + copy_agents_table() + "\n")
    print("## KVCOMM\n\n### Session 5: `kvcomm` = the L2 gate, warm-up 2 (the public code's); "
          "`kvcomm[gate_distance=relative,warmup=3]` = the gate before\n")
    print_kvcomm_tables("-s5")
    print("### Session 6: the same calls with warm pools (the 50 problems after the measured ones run through "
          "`kvcomm` unrecorded first: `--warm-problems 50`)\n")
    print_kvcomm_tables("-warm")
    for name in ("kvcomm-gsm8k-fc3", "kvcomm-mmlu-fc3", "kvcomm-humaneval-fc3"):
        path = RESULTS / f"{name}-warm-gamma.json"
        if path.exists():
            print(f"γ below the default with warm pools, {name.removeprefix('kvcomm-')} (session 7)\n\n"
                  + kvcomm_table(path) + "\n")
    print("### Session 9: the prompt's last tokens computed (`tail_tokens`), warm pools, γ = 0.3 "
          "(`tail_tokens=1` is the session-6 `kvcomm` row above, the same calls)\n")
    for name in ("kvcomm-gsm8k-fc3", "kvcomm-mmlu-fc3", "kvcomm-humaneval-fc3"):
        path = RESULTS / f"{name}-warm-tail.json"
        if path.exists():
            print(kvcomm_table(path) + "\n")
    path = RESULTS / "kvcomm-gsm8k-fc3-warm-s10.json"
    if path.exists():
        print("### Session 10: `kvcomm[tail_tokens=32]` with rotated and with absolute offsets, and the baselines, "
              "in one warm run (the same calls as sessions 6 and 9)\n\n" + kvcomm_table(path) + "\n")
    if (RESULTS / "kvcomm-copy-agents-2-s10.json").exists():
        print("copy-agents, last agent, with `tail_tokens=32` (session 10):\n\n"
              + kvcomm_copy_agents_table("kvcomm-copy-agents-{a}-s10.json") + "\n")
    print("### Sessions 1-2: `kvcomm` = the relative gate (temperature 0.01), warm-up 3\n")
    for name in ("kvcomm-gsm8k-fc3", "kvcomm-mmlu-fc3", "kvcomm-humaneval-fc3", "kvcomm-gsm8k-fc3-e2e"):
        path = RESULTS / f"{name}.json"
        if path.exists():
            print(kvcomm_table(path) + "\n")
    print("### copy-agents: last agent's TTFT speedup over full, kvcomm and relay\n\n" + kvcomm_copy_agents_table())
    print("\n## RKSC (gsm8k-branches)\n\n### Branches decoded in one batch over the shared root (rksc's default)\n\n"
          + rksc_tables("rksc-batch-gsm8k-branches"))
    print("\n### RSBCM vs LRU with several problems in flight\n\n" + interleaved_table())
    print("\n### RSBCM vs LRU with a deep shared prefix (few-shot system prompts, two example sets taking turns)\n\n"
          + interleaved_table("rksc-rsbcm-fewshot.json"))
    print("\n### Branches decoded one by one (sessions 1-2, before batched decode)\n\n" + rksc_tables())
    print("\n### Approximate ASKS\n\n" + asks_table())
    print("\n### Where a verification's time goes\n\n" + verifier_overhead_table())
