"""Issue 23's frontier targets from bench JSON (agent mode): does relay dominate epic, cacheblend and naive?

    python research/relay_frontier.py RUN.json [LANE2.json ...] --plot OUT.png [--json OUT.json]

Lanes of one run (``--offset``) are merged from their per-call rows. For every relay variant in the
run, against each baseline b in (epic, cacheblend, naive):
- dominance: reuse >= b's, KL(first token) <= 0.5 x epic's (the issue's bar, against every baseline)
  and greedy@32 >= epic's;
- the plain Pareto test: reuse >= b's, KL <= b's, greedy@32 >= b's.
And relay's first-token target: >= 0.95 overall and >= 0.98 on clear calls at reuse >= 0.90 x naive's.
The plot has KL (log) and greedy@32 against reuse, one point per method, the region the dominance
target asks for shaded.
"""

from __future__ import annotations

import argparse
import json

from kvrelay.eval.report import merge_results
from kvrelay.eval.result_files import read_json

BASELINES = ("epic", "cacheblend", "naive")


def targets(results: dict[str, dict]) -> dict:
    epic = results["epic"]
    naive = results["naive"]
    out: dict[str, dict] = {}
    for name, s in results.items():
        if not name.startswith("relay"):
            continue
        row: dict = {"reuse_rate": s["reuse_rate"], "kl_first_token": s["kl_first_token"],
                     "greedy_match_rate": s["greedy_match_rate"], "first_token_agreement": s["first_token_agreement"],
                     "first_token_agreement_clear": s["first_token_agreement_clear"]}
        for b in BASELINES:
            if b not in results:
                continue
            base = results[b]
            row[f"dominates_{b}"] = (s["reuse_rate"] >= base["reuse_rate"] and
                                     s["kl_first_token"] <= 0.5 * epic["kl_first_token"] and
                                     s["greedy_match_rate"] >= epic["greedy_match_rate"])
            row[f"pareto_over_{b}"] = (s["reuse_rate"] >= base["reuse_rate"] and
                                       s["kl_first_token"] <= base["kl_first_token"] and
                                       s["greedy_match_rate"] >= base["greedy_match_rate"])
        row["kl_over_epic"] = s["kl_first_token"] / epic["kl_first_token"] if epic["kl_first_token"] else None
        row["reuse_over_epic"] = s["reuse_rate"] / epic["reuse_rate"]
        row["reuse_over_naive"] = s["reuse_rate"] / naive["reuse_rate"]
        clear = s["first_token_agreement_clear"]
        row["first_token_target"] = (s["first_token_agreement"] >= 0.95 and clear is not None and clear >= 0.98
                                     and s["reuse_rate"] >= 0.90 * naive["reuse_rate"])
        out[name] = row
    return out


def markdown(result: dict, table: dict, sources: list[str]) -> str:
    """The run's methods and relay's targets as BENCHMARKS.md tables."""
    env = result["env"]
    lines = [f"`{result['workload']}`, {result['model']}, {result['n']} problems "
             f"({', '.join(f'`{s}`' for s in sources)}; commit {env['commit']}, {env['machine']})", "",
             "| method | reuse | recompute | 1st token | 1st token, clear calls | KL(full‖m) | greedy@32 | "
             "speedup vs full | ideal |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m, s in result["results"].items():
        clear = s["first_token_agreement_clear"]
        lines.append(f"| {m} | {s['reuse_rate']:.3f} | {s['recompute_frac']:.3f} | {s['first_token_agreement']:.2f} | "
                     f"{'–' if clear is None else format(clear, '.2f')} | {s['kl_first_token']:.4f} | "
                     f"{s['greedy_match_rate']:.2f} | {s['speedup_vs_full']:.2f}× | {s['ideal_speedup']:.2f}× |")
    lines += ["", "| relay variant | reuse / epic's | KL / epic's | greedy@32 ≥ epic's | dominates epic | "
              "dominates cacheblend | dominates naive | 1st ≥ 0.95, clear ≥ 0.98 at reuse ≥ 0.9 × naive's |",
              "|---|---:|---:|---|---|---|---|---|"]
    epic_greedy = result["results"]["epic"]["greedy_match_rate"]
    for m, row in table.items():
        yes = {True: "yes", False: "no"}
        lines.append(f"| {m} | {row['reuse_over_epic']:.3f} | {row['kl_over_epic']:.2f} | "
                     f"{yes[row['greedy_match_rate'] >= epic_greedy]} | {yes[row['dominates_epic']]} | "
                     f"{yes[row.get('dominates_cacheblend', False)]} | {yes[row['dominates_naive']]} | "
                     f"{yes[row['first_token_target']]} |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = {m: s for m, s in result["results"].items() if m not in ("full", "prefix")}
    epic = results["epic"]
    cmap = plt.get_cmap("tab10")
    fig, (ax_kl, ax_g) = plt.subplots(1, 2, figsize=(12, 6))
    for k, (m, s) in enumerate(results.items()):
        color = cmap(k % 10)
        marker = "o" if m.startswith("relay") else "s"
        ax_kl.scatter(s["reuse_rate"], s["kl_first_token"], color=color, marker=marker, s=60, label=m)
        ax_g.scatter(s["reuse_rate"], s["greedy_match_rate"], color=color, marker=marker, s=60)
    lo_kl = min(s["kl_first_token"] for s in results.values()) / 2
    ax_kl.fill_between([epic["reuse_rate"], 1.0], lo_kl, 0.5 * epic["kl_first_token"], color="green", alpha=0.12,
                       label="target: reuse >= epic's, KL <= 0.5 x epic's")
    ax_g.fill_between([epic["reuse_rate"], 1.0], epic["greedy_match_rate"], 1.02, color="green", alpha=0.12)
    ax_kl.set_yscale("log")
    ax_kl.set_xlabel("reuse rate (token-layers)")
    ax_kl.set_ylabel("KL(full || method), first token (log)")
    ax_g.set_xlabel("reuse rate (token-layers)")
    ax_g.set_ylabel("greedy@32 match with full")
    for ax in (ax_kl, ax_g):
        ax.grid(alpha=0.3)
    fig.legend(*ax_kl.get_legend_handles_labels(), fontsize=8, loc="lower center", ncols=2)
    fig.suptitle(f"relay's frontier: {result['workload']} on {result['model']} ({result['n']} problems, "
                 f"{results['epic']['n_calls']} downstream calls)")
    fig.tight_layout(rect=(0, 0.22, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="bench JSON files (lanes of one run)")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", action="store_true", help="print BENCHMARKS.md tables instead")
    args = ap.parse_args()
    lanes = [read_json(p) for p in args.runs]
    result = merge_results(lanes) if len(lanes) > 1 else lanes[0]
    table = targets(result["results"])
    if args.markdown:
        print(markdown(result, table, [p.rsplit("/", 1)[-1] for p in args.runs]))
    for m, s in ([] if args.markdown else result["results"].items()):
        print(f"{m:45s} reuse {s['reuse_rate']:.3f}  KL {s['kl_first_token']:.4f}  "
              f"greedy {s['greedy_match_rate']:.2f}  1st {s['first_token_agreement']:.2f} "
              f"/ clear {s['first_token_agreement_clear'] or 0:.2f}")
    for m, row in ([] if args.markdown else table.items()):
        flags = ", ".join(f"{k}={v}" for k, v in row.items() if k.startswith(("dominates", "pareto", "first_token_t")))
        print(f"{m:45s} KL/epic {row['kl_over_epic']:.2f}  reuse/epic {row['reuse_over_epic']:.3f}  "
              f"reuse/naive {row['reuse_over_naive']:.3f}  {flags}")
    if args.plot:
        plot(result, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sources": args.runs, "model": result["model"], "workload": result["workload"],
                       "n": result["n"], "targets": table}, f, indent=1)


if __name__ == "__main__":
    main()
