"""Markdown renderers for BENCHMARKS.md's tables, one per kind of result JSON (no number typed by hand).

Each renderer takes the JSON files a table names (``benchmarks/results/``) and returns the table with a caption
that names those files, the command that wrote them (rebuilt from the JSON's own ``config`` where it has one), the
commit and the machine. ``make_tables.py`` says which table reads which files.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from pathlib import Path

from kvrelay.eval.report import merge_results
from kvrelay.eval.result_files import read_json
from kvrelay.eval.stats import mean, median, median_ratio
from kvrelay.reuse import get_method

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_GREEDY_TOKENS = 32


def result_path(name: str) -> Path:
    """A result file as the tree keeps it: ``name``, or ``name.gz`` (large files are kept gzipped)."""
    path = RESULTS / name
    return path if path.is_file() else path.with_name(name + ".gz")


def load(name: str) -> dict:
    return read_json(result_path(name))


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "–" if value is None else format(value, spec) + suffix


def _files(names: Sequence[str]) -> str:
    return ", ".join(f"`{result_path(n).name}`" for n in names)


def bench_command(cfg: dict, env: dict, out_name: str, methods: Sequence[str] | None = None) -> str:
    """The ``kvrelay bench`` command line that wrote a result, rebuilt from its recorded config; ``methods``: the
    specs to name instead of the recorded ones (a table's rows, in today's spelling)."""
    threads = "OMP_NUM_THREADS=1 " if "1 torch threads" in env.get("machine", "") else ""
    args = ["kvrelay", "bench", "--workload", cfg["workload"], "--model", cfg["model"],
            "--methods", ",".join(cfg["methods"] if methods is None else methods), "--limit", str(cfg["limit"])]
    if cfg.get("offset"):
        args += ["--offset", str(cfg["offset"])]
    if cfg.get("mode", "agent") != "agent":
        args += ["--mode", cfg["mode"]]
    if cfg.get("repeats") is not None:
        args += ["--repeats", str(cfg["repeats"])]
    if cfg.get("greedy_tokens", DEFAULT_GREEDY_TOKENS) != DEFAULT_GREEDY_TOKENS:
        args += ["--greedy-tokens", str(cfg["greedy_tokens"])]
    # a warm-up that fed only methods since removed leaves the rows unchanged, and kvrelay bench refuses one
    # with no stateful method to warm
    named = cfg["methods"] if methods is None else methods
    if cfg.get("warm_problems") and any(get_method(m).stateful for m in named):
        args += ["--warm-problems", str(cfg["warm_problems"])]
        if cfg.get("warm_data"):
            args += ["--warm-data", cfg["warm_data"]]
    if cfg.get("keep_store"):
        args.append("--keep-store")
    if cfg.get("device", "cpu") != "cpu":
        args += ["--device", cfg["device"]]
    return threads + shlex.join(args + ["--json", f"benchmarks/results/{out_name}"])


def _bench_runs(names: Sequence[str]) -> tuple[dict, list[tuple[str, dict, dict]]]:
    """The merged result of a table's files and, per run that wrote them, (file, config, env). A file made by
    merging earlier runs (``combined_from``) lists each lane's config."""
    docs = [load(n) for n in names]
    merged = docs[0] if len(docs) == 1 else merge_results(docs)
    runs = []
    for name, d in zip(names, docs, strict=True):
        if "lanes" in d:  # merged after the fact: each lane wrote its own file
            stem = name.removesuffix(".json").removesuffix("-combined")
            runs += [(f"{stem}-lane{lane['config']['offset']}.json", lane["config"], lane["env"])
                     for lane in d["lanes"]]
        else:
            runs.append((name, d["config"], d["env"]))
    return merged, runs


def bench_table(names: Sequence[str], rows: dict[str, str], specs_now: dict[str, str] | None = None) -> str:
    """Agent-mode rows of one model x workload. ``rows``: method as the JSON names it -> label shown (in order).
    The commands name the rows' methods only, each as ``specs_now`` spells it today (a setting renamed since the
    run), so they reproduce the table with the methods that exist."""
    specs_now = specs_now or {}
    d, runs = _bench_runs(names)
    commits = ", ".join(dict.fromkeys(env["commit"] for _, _, env in runs))
    machines = "; ".join(dict.fromkeys(env["machine"] for _, _, env in runs))
    # the run's warm-up is named only where a row's method kept state from it
    warm = (d.get("warm_problem_ids") or []) if any(get_method(specs_now.get(m, m)).stateful for m in rows) else []
    num_problems = len({c["problem_id"] for c in d["calls"]})
    lines = [f"{d['model']}, {d['workload']}, {num_problems} problems ({_problem_range(d)}), "
             f"{d['results']['full']['n_calls']} downstream calls" + (f", pools warmed on {len(warm)} problems"
                                                                       if warm else "")
             + f"; {d['env']['device']}, {machines}; commit {commits}; {_files(names)}", "",
             "| method | TTFT ms (median) | speedup vs full | ideal | share of ideal | reuse | recompute | "
             "1st-token agree | on clear calls | KL(full‖m) | greedy@32 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for method, label in rows.items():
        s = d["results"][method]
        share = None if s["speedup_vs_full"] is None or not s["ideal_speedup"] else \
            s["speedup_vs_full"] / s["ideal_speedup"]
        lines.append(f"| {label} | {fmt(s['ttft_ms_median'], '.0f')} | {fmt(s['speedup_vs_full'], '.2f', '×')} | "
                     f"{fmt(s['ideal_speedup'], '.2f', '×')} | {fmt(share, '.2f')} | {fmt(s['reuse_rate'], '.3f')} | "
                     f"{fmt(s['recompute_frac'], '.3f')} | {fmt(s['first_token_agreement'], '.2f')} | "
                     f"{fmt(s.get('first_token_agreement_clear'), '.2f')} | {fmt(s['kl_first_token'], '.4f')} | "
                     f"{fmt(s['greedy_match_rate'], '.2f')} |")
    specs = [f"`{label}` = `{specs_now.get(m, m)}`" for m, label in rows.items() if label != specs_now.get(m, m)]
    specs += [f"`{now}` was spelled `{m}` in the run's config" for m, now in specs_now.items() if m in rows]
    if earlier := [label for m, label in rows.items() if not any(m in cfg["methods"] for _, cfg, _ in runs)]:
        specs.append(", ".join(f"`{label}`" for label in earlier) + " came from earlier runs with the same arguments "
                     "(the file's `combined_from`): add them to `--methods` to measure them again")

    def methods(cfg: dict) -> list[str]:
        return [specs_now.get(m, m) for m in cfg["methods"] if m in rows]

    lines += ["", "Commands: " + "; ".join(f"`{bench_command(cfg, env, name, methods(cfg))}`"
                                           for name, cfg, env in runs)
              + (" (lanes side by side, merged from their per-call rows)" if len(runs) > 1 else "") + "."]
    if specs:
        lines.append("Rows: " + "; ".join(specs) + ".")
    return "\n".join(lines)


def _problem_range(d: dict) -> str:
    problems = sorted({c["problem_id"] for c in d["calls"]}, key=lambda p: int(re.findall(r"\d+", p)[-1]))
    return f"{problems[0]} to {problems[-1]}"


def summary_table(groups: Sequence[tuple[Sequence[str], dict[str, str]]]) -> str:
    """One row per method x model x workload, read from the same files as the per-workload tables."""
    lines = ["| model | workload (problems) | method | speedup vs full | share of ideal | reuse | 1st-token agree | "
             "KL(full‖m) | greedy@32 |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for names, rows in groups:
        d, _ = _bench_runs(names)
        for method, label in rows.items():
            s = d["results"][method]
            share = s["speedup_vs_full"] / s["ideal_speedup"]
            lines.append(f"| {d['model']} | {d['workload']} ({_problem_range(d)}) | {label} | "
                         f"{fmt(s['speedup_vs_full'], '.2f', '×')} | {share:.2f} | {fmt(s['reuse_rate'], '.3f')} | "
                         f"{fmt(s['first_token_agreement'], '.2f')} | {fmt(s['kl_first_token'], '.4f')} | "
                         f"{fmt(s['greedy_match_rate'], '.2f')} |")
    files = [name for names, _ in groups for name in names]
    return "\n".join([*lines, "", f"Files (in `benchmarks/results/`): {_files(files)}."])


def copy_agents_table(names: Sequence[str], methods: Sequence[str]) -> str:
    """copy-agents:N, the last agent's TTFT speedup over full per method, one row per N."""
    head = "| agents | last agent's prompt tokens | full TTFT ms | " + " | ".join(methods) + " | ideal | " \
        + "1st-token agree: " + " / ".join(methods) + " |"
    lines = [head, "|---:|---:|---:|" + "---:|" * (len(methods) + 2)]
    runs = []
    for name in names:
        d = load(name)
        res, by_agent = d["results"], d["results"]["full"]["by_agent"]
        last = max(by_agent, key=lambda k: by_agent[k]["position"])
        base = by_agent[last]
        cells = [fmt(res[m]["by_agent"][last]["speedup_vs_full"], ".2f", "×") for m in methods]
        agree = " / ".join(fmt(res[m]["first_token_agreement"], ".2f") for m in methods)
        lines.append(f"| {d['workload'].split(':')[1]} | {base['num_prompt_tokens_median']:.0f} | "
                     f"{base['ttft_ms_median']:.0f} | " + " | ".join(cells) + f" | {base['ideal_speedup']:.2f}× | "
                     f"{agree} |")
        runs.append((name, d))
    d0 = runs[0][1]
    return "\n".join([f"{d0['model']}, {d0['n']} problems per N; {d0['env']['device']}, {d0['env']['machine']}; "
                      f"commit {d0['env']['commit']}; {_files(names)}", "", *lines, "",
                      "Command: " + "; ".join(f"`{bench_command(d['config'], d['env'], n)}`" for n, d in runs) + "."])


def kvcomm_table(names: Sequence[str], method: str = "kvcomm") -> str:
    """kvcomm per workload: reuse, how often a call falls back to a full prefill, and fidelity over all calls."""
    lines = ["| workload | problems | calls | reuse/call | fallback | speedup vs full | ideal | 1st-token agree | "
             "KL(full‖m) | greedy@32 | commit |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    cmds, d = [], {}
    for name in names:
        d = load(name)
        s = d["results"][method]
        lines.append(f"| {d['workload']} | {d['n']} | {s['n_calls']} | {fmt(s['reuse_rate_per_call'], '.2f')} | "
                     f"{fmt(s['fallback_rate'], '.2f')} | {fmt(s['speedup_vs_full'], '.2f', '×')} | "
                     f"{fmt(s['ideal_speedup'], '.2f', '×')} | {fmt(s['first_token_agreement'], '.2f')} | "
                     f"{fmt(s['kl_first_token'], '.4f')} | {fmt(s['greedy_match_rate'], '.2f')} | "
                     f"{d['env']['commit']} |")
        cmds.append(f"`{bench_command(d['config'], d['env'], name)}`")
    return "\n".join([f"`{method}` (defaults), {d['model']}, pools warmed on {len(d.get('warm_problem_ids') or [])} "
                      f"problems before the measured ones; {d['env']['device']}, {d['env']['machine']}; "
                      f"{_files(names)}", "", *lines, "", "Commands: " + "; ".join(cmds) + "."])


def _branch_summary(records: list[dict], method: str) -> dict:
    """The columns rksc's table shows, as ``kvrelay.eval.branch_bench.summarize_branches`` defines them, computed
    here so that rendering does not import the branch runner (and torch)."""
    runs = [r["runs"][method] for r in records]
    full = [r["runs"]["full"] for r in records]
    prefix = [r["runs"]["prefix"] for r in records]
    return {"total_ms_median": median([x["total_ms"] for x in runs]),
            "speedup_vs_full": median_ratio([x["total_ms"] for x in full], [x["total_ms"] for x in runs]),
            "speedup_vs_prefix": median_ratio([x["total_ms"] for x in prefix], [x["total_ms"] for x in runs]),
            "computed_token_share": sum(x["num_computed_tokens"] for x in runs)
            / sum(x["num_prompt_tokens"] for x in full),
            "kv_over_root_plus_own": mean([x["branch_kv_bytes"] / x["root_plus_own_bytes"] for x in runs]),
            "accuracy": mean([float(x["correct"]) for x in runs]),
            "pick_agrees_with_full": mean([float(x["pick"] == f["pick"]) for x, f in zip(runs, full, strict=True)])}


def rksc_table(names: Sequence[str]) -> str:
    """gsm8k-branches: the lanes' problems merged and summarized again from their per-problem rows."""
    docs = [load(n) for n in names]
    records = [r for d in docs for r in d["problems"]]
    d0, cfg = docs[0], docs[0]["config"]
    lines = [f"{d0['model']}, gsm8k-branches, {len(records)} problems, B={cfg['branches']} branches × "
             f"T={cfg['branch_tokens']} tokens; {d0['env']['device']}, {d0['env']['machine']}; commit "
             f"{', '.join(dict.fromkeys(d['env']['commit'] for d in docs))}; {_files(names)}", "",
             "| method | total ms (median) | speedup vs full | vs prefix | prompt tokens computed | "
             "KV / (root + own) | pick accuracy | pick = full's |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for m in d0["results"]:
        x = _branch_summary(records, m)
        lines.append(f"| {m} | {x['total_ms_median']:.0f} | {x['speedup_vs_full']:.2f}× | "
                     f"{x['speedup_vs_prefix']:.2f}× | {x['computed_token_share']:.2f} | "
                     f"{x['kv_over_root_plus_own']:.2f} | {x['accuracy']:.2f} | {x['pick_agrees_with_full']:.2f} |")
    cmds = []
    for name, d in zip(names, docs, strict=True):
        c = d["config"]
        cmds.append(f"`OMP_NUM_THREADS=1 kvrelay bench --workload gsm8k-branches --model {d['model']} --methods "
                    f"'{','.join(d['results'])}' --limit {d['n']} --offset {c.get('offset', 0)} --json "
                    f"benchmarks/results/{name}`")
    return "\n".join([*lines, "", "Commands: " + "; ".join(cmds) + " (lanes side by side)."])


# bench_engine.py's flags for a file written before it recorded them (engine_cpu.json: 9 repeats)
ENGINE_FLAGS_UNRECORDED = {"repeats": 9}


def engine_command(d: dict, name: str) -> str:
    """The bench_engine.py command that wrote ``d``: its recorded flags, else the 4-bit decode where it has one."""
    cfg = d.get("config") or {**ENGINE_FLAGS_UNRECORDED, "int4_decode": "int4_tokens_per_s_median" in d["decode"]}
    args = ["python", "benchmarks/bench_engine.py"]
    if cfg.get("model", "smollm2-135m") != "smollm2-135m":
        args += ["--model", cfg["model"]]
    for flag in ("prompt_tokens", "new_tokens", "repeats"):
        if flag in cfg:
            args += [f"--{flag.replace('_', '-')}", str(cfg[flag])]
    if cfg.get("int4_decode"):
        args.append("--int4-decode")
    return shlex.join(args + ["--json", f"benchmarks/results/{name}"])


def engine_table(name: str) -> str:
    return render_engine(load(name), name)


def render_engine(d: dict, name: str) -> str:
    p, dec, ld = d["prefill"], d["decode"], d["load"]
    int4 = [f"| decode on the GGUF's 4-bit weights, tokens/s | {dec['int4_tokens_per_s_median']:.1f} | – | – | "
            f"{dec['ratio_int4_over_transformers']:.2f} |"] if "int4_tokens_per_s_median" in dec else []
    return "\n".join([
        f"{d['model']}, fp32; {d['env']['device']}, {d['env']['machine']}, torch {d['env']['torch']}; commit "
        f"{d['env']['commit']}; `{name}`", "",
        "| what | ours (weights packed for oneDNN) | ours (`F.linear`) | transformers | ours / transformers |",
        "|---|---:|---:|---:|---:|",
        f"| prefill {p['prompt_tokens']} tokens, ms (median) | {p['ours_ms_median']:.0f} | "
        f"{p['ours_unpacked_ms_median']:.0f} | {p['transformers_ms_median']:.0f} | "
        f"{p['ratio_ours_over_transformers']:.2f} |",
        f"| decode, tokens/s (median) | {dec['ours_tokens_per_s_median']:.1f} | "
        f"{dec['ours_unpacked_tokens_per_s_median']:.1f} | {dec['transformers_tokens_per_s_median']:.1f} | "
        f"{dec['ratio_ours_over_transformers']:.2f} |",
        *int4,
        f"| second load of the model, s (fresh process) | {ld['second_load_s_median']:.1f} | – | – | – |",
        f"| max abs logit difference (prefill, fp32) | {p['max_abs_logit_diff']:.1e} | | | |", "",
        f"Command: `{engine_command(d, name)}`."])


def serve_chain_table(name: str, inprocess: str) -> str:
    """Over HTTP: each downstream call probed with every method and compared with ``full`` on the same messages;
    beside it, the in-process bench on the same problems (``inprocess``)."""
    d, local = load(name), load(inprocess)
    env, methods = d["env"], ",".join(d["results"])
    lines = [f"{d['model']}, {d['workload']}, {d['n']} problems over HTTP (`kvrelay serve`, the `openai` client), "
             f"each method against `full` on the same messages, beside `kvrelay bench` in process on the same "
             f"problems (each pair: HTTP / in process); {env['device']}, {env['machine']}; commit {env['commit']}; "
             f"{_files([name, inprocess])}", "",
             "| method | calls | reuse | 1st-token agree | KL(full‖m) | greedy@32 | speedup vs full | "
             "cached tokens (mean, HTTP) |", "|---|---:|---|---|---|---|---|---:|"]

    def pair(s: dict, t: dict, key: str, spec: str, suffix: str = "") -> str:
        return f"{fmt(s.get(key), spec, suffix)} / {fmt(t.get(key), spec, suffix)}"

    for m, s in d["results"].items():
        t = local["results"][m]
        lines.append(f"| {m} | {s['n_calls']} | {pair(s, t, 'reuse_rate', '.3f')} | "
                     f"{pair(s, t, 'first_token_agreement', '.2f')} | {pair(s, t, 'kl_first_token', '.4f')} | "
                     f"{pair(s, t, 'greedy_match_rate', '.2f')} | {pair(s, t, 'speedup_vs_full', '.2f', '×')} | "
                     f"{s['cached_tokens_mean']:.0f} |")
    lines += ["", f"Commands: `OMP_NUM_THREADS=1 kvrelay serve --model {d['model']} --methods {methods} --port 8049` "
              f"then `OMP_NUM_THREADS=1 python benchmarks/serve_chain.py --base-url http://127.0.0.1:8049/v1 --limit "
              f"{d['n']} --methods {methods} --json benchmarks/results/{name}`; "
              f"`{bench_command(local['config'], local['env'], inprocess)}`."]
    return "\n".join(lines)


def serve_load_table(name: str) -> str:
    d = load(name)
    lines = [f"{d['model']}, concurrent clients each running 3-agent chains against one `kvrelay serve`; "
             f"{d['env']['machine']}; `{name}`", "",
             "| clients | seconds | requests | failed | TTFT p50 ms | TTFT p99 ms | tokens/s | cached tokens (mean) | "
             "RSS MB (start → end) |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in d["phases"]:
        lines.append(f"| {p['clients']} | {p['seconds']:.0f} | {p['requests']} | {p['failed']} | "
                     f"{p['ttft_ms_p50']:.0f} | {p['ttft_ms_p99']:.0f} | {p['tokens_per_s']:.1f} | "
                     f"{p['cached_tokens_mean']:.0f} | {p['rss_mb_start']:.0f} → {p['rss_mb_end']:.0f} |")
    clients = ",".join(str(p["clients"]) for p in d["phases"])
    lines += ["", f"Command: `kvrelay serve --model {d['model']} --port 8012` then `python benchmarks/serve_load.py "
              f"--base-url http://127.0.0.1:8012/v1 --clients {clients} --seconds S1,S2 --json "
              f"benchmarks/results/{name}`, one phase per client count (the seconds column: a phase ends when its "
              "time is up and its chains finish)."]
    return "\n".join(lines)


def serve_index_table(name: str) -> str:
    d = load(name)
    spans = sorted({r["num_spans"] for r in d["rows"]})
    lengths = sorted({r["prompt_tokens"] for r in d["rows"]})
    by = {(r["num_spans"], r["prompt_tokens"]): r for r in d["rows"]}
    lines = [f"Matching a prompt against stored spans of {d['span_tokens']} tokens (no model, no torch); "
             f"{d['machine']}, Python {d['python']}; `{name}`", "",
             "| stored spans | " + " | ".join(f"lookup ms, {n:,}-token prompt" for n in lengths)
             + " | index build ms per span |", "|---:|" + "---:|" * (len(lengths) + 1)]
    for s in spans:
        lines.append(f"| {s:,} | " + " | ".join(f"{by[s, n]['lookup_ms']:.2f}" for n in lengths)
                     + f" | {by[s, lengths[0]]['index_build_ms_per_span']:.2f} |")
    lines += ["", f"Command: `python benchmarks/serve_index.py --json benchmarks/results/{name}`."]
    return "\n".join(lines)


def tier_fetch_table(name: str) -> str:
    d = load(name)
    lines = [f"One span of {d['model']}'s K/V (plus one layer of hidden states): recomputing its tokens against "
             f"fetching it from each tier; {d['env']['device']}, {d['env']['machine']}; commit {d['env']['commit']}; "
             f"`{name}`", "",
             "| span tokens | span MB | recompute ms | memory fetch ms | load into a sequence ms | disk fetch ms | "
             "Redis fetch ms | disk MB/s | Redis MB/s |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in d["rows"]:
        lines.append(f"| {r['num_tokens']:,} | {r['span_mb']:.1f} | {r['recompute_ms']:.0f} | "
                     f"{r['memory_fetch_ms']:.4f} | {r['load_into_sequence_ms']:.2f} | {r['disk_fetch_ms']:.1f} | "
                     f"{r['redis_fetch_ms']:.1f} | {r['disk_mb_per_s']} | {r['redis_mb_per_s']} |")
    lines += ["", f"Command: `python benchmarks/tier_fetch.py --json benchmarks/results/{name}` (starts its own "
              "redis-server on a free loopback port)."]
    return "\n".join(lines)


def llamacpp_table(name: str) -> str:
    """Median TTFT of every kvrelay method and of llama.cpp on the same downstream calls, per workload."""
    d = load(name)
    cfg, env = d["config"], d["env"]
    workloads = list(d["summary"])
    summary = {w: d["summary"][w]["all"] for w in workloads}
    engines = list(summary[workloads[0]]["median_ttft_ms"])
    lines = [f"{d['model']}: llama.cpp (llama-cpp-python {env['llama_cpp_python']}) and kvrelay on the same "
             f"downstream calls and token ids, median TTFT over all downstream calls; {env['device']}, "
             f"{env['machine']}; commit {env['commit']}; `{name}`", "",
             "| engine / method | " + " | ".join(f"{w} ({summary[w]['num_calls']} calls, median prompt "
                                                f"{summary[w]['median_prompt_tokens']:.0f} tokens): ms, vs kvrelay full"
                                                for w in workloads) + " |", "|---|" + "---:|" * len(workloads)]
    for e in engines:
        ttft = [summary[w]["median_ttft_ms"] for w in workloads]
        cells = [f"{t[e]:.0f} ({t['full'] / t[e]:.2f}×)" for t in ttft]
        lines.append(f"| {e} | " + " | ".join(cells) + " |")
    lines += ["", f"Command: `OMP_NUM_THREADS={cfg['threads']} python benchmarks/llamacpp_side_by_side.py "
              f"--workloads {cfg['workloads']} --limit {cfg['limit']} --copy-limit {cfg['copy_limit']} --methods "
              f"{cfg['methods']} --json benchmarks/results/{name}` (needs `pip install -e '.[bench]'`)."]
    return "\n".join(lines)
