"""The quality guard on real calls: the server's guard logic fed only what it would see, scored against every rung.

    OMP_NUM_THREADS=1 python benchmarks/quality_guard.py --model smollm2-135m --limit 30 \
        --json benchmarks/results/quality-guard-smollm2.json --plots benchmarks/results/quality-guard-smollm2

For each workload (problems the guard's defaults were not chosen on: GSM8K test problems from 100, HumanEval
from 120, MMLU from 100), ``quality_measure`` runs every rung of the default ladder and ``full`` on every
downstream call. Then, per role (a downstream agent of a workload), the calls are replayed in order through a
``QualityGuard`` with its default config: the guard picks the rung of each call, decides whether to shadow it,
and is fed that rung's measured KL and agreement only on the calls it shadows (the shadow's cost is the call's
``full`` prefill). Reported per role, against the target, on what the live calls got at the guard's rungs:

- quality over the calls after the first 20 (and over all), mean first-token KL and top-1 agreement;
- reuse (token-layers) against the best single rung that meets the target on that role, chosen in hindsight;
- the shadow references' share of the compute (their prefills over the live calls' prefill + decode + shadows),
  the share counting prefills only (a bound that ignores decoding), and the share in a long run, where only
  ``sample_rate`` of the calls are shadowed;
- a PNG per role of the rung and the live call's KL over its calls.

``--calls-json`` replays rows measured earlier (the measurement is the slow part; the replay takes no model). The rows
are written gzipped beside the report (``.calls.json.gz``: the results kept in the tree have a size budget);
``--calls-json`` reads them gzipped or plain.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from statistics import mean

from kvrelay.eval.result_files import read_json, write_json_gz
from kvrelay.quality import QualityConfig, QualityGuard

# past every shipped row and every problem a shipped profile was calibrated on (Gemma 3's selector: HumanEval
# 110-119; GSM8K calibration reads the train split, these the test split)
WORKLOAD_OFFSETS = {"gsm8k-chain3": 100, "humaneval-adr": 120, "mmlu-fc3": 100}
QUALITY_AFTER_CALLS = 20


def replay_role(rows: list[dict], config: QualityConfig, namespace: str = "bench") -> tuple[list[dict], dict]:
    """The guard over one role's calls in order: per call the rung it ran at, whether it was shadowed, and the
    live call's measured quality and cost at that rung; and the guard's aggregates at the end."""
    guard = QualityGuard(config)
    trace = []
    for row in rows:
        role = row["agent"]
        rung = guard.rung_for(namespace, role)
        shadow = guard.should_shadow(namespace, role)
        got = row["rungs"][rung.name]
        if shadow:
            guard.record(namespace, role, rung.name, got["kl"], got["agree"], None, row["rungs"]["full"]["ttft_ms"])
        trace.append({"rung": rung.name, "shadow": shadow, "kl": got["kl"], "agree": got["agree"],
                      "reused_token_layers": got["reused_token_layers"],
                      "prompt_token_layers": got["prompt_token_layers"], "prefill_ms": got["ttft_ms"],
                      "decode_ms": row["decode_ms"], "shadow_ms": row["rungs"]["full"]["ttft_ms"] if shadow else 0.0,
                      "shadow_token_layers": got["prompt_token_layers"] if shadow else 0})
    return trace, guard.aggregates()


def bench_rung_settings(paths: list[str], rung_methods: dict[str, str]) -> dict[str, dict[str, dict]]:
    """Per rung and workload, what its method resolved to in the bench files (their ``method_settings``: relay's
    layers and selector), so a replay says which relay it measured; a rung whose method the bench did not record
    (one that resolves nothing from the model) is left out."""
    settings: dict[str, dict[str, dict]] = {}
    for path in paths:
        data = read_json(Path(path))
        for rung, method in rung_methods.items():
            if method in data.get("method_settings", {}):
                settings.setdefault(rung, {})[data["workload"]] = data["method_settings"][method]
    return settings


def rows_from_bench(paths: list[str], rung_methods: dict[str, str]) -> list[dict]:
    """Rows in ``quality_measure``'s form from ``kvrelay bench`` JSON files (agent mode, their per-call rows):
    ``rung_methods`` maps a rung to the bench's method name for it. These carry no decode time."""
    rows: dict[tuple, dict] = {}
    for path in paths:
        data = read_json(Path(path))
        for c in data["calls"]:
            key = (data["workload"], c["problem_id"], c["agent"])
            row = rows.setdefault(key, {"workload": data["workload"], "problem_id": c["problem_id"],
                                        "agent": c["agent"], "position": c["position"], "decode_ms": None,
                                        "num_prompt_tokens": c["num_prompt_tokens"], "rungs": {}})
            for rung, method in {**rung_methods, "full": "full"}.items():
                if c["method"] == method:
                    row["rungs"][rung] = {"kl": c["kl_first_token"], "agree": c["first_token_agree"],
                                          "reused_token_layers": c["reused_token_layers"],
                                          "prompt_token_layers": c["prompt_token_layers"], "ttft_ms": c["ttft_ms"]}
    wanted = {*rung_methods, "full"}
    missing = {k for k, r in rows.items() if not wanted <= set(r["rungs"])}
    if missing:
        raise SystemExit(f"{len(missing)} calls lack a rung's method in {paths} (rungs: {rung_methods})")
    return sorted(rows.values(), key=lambda r: (r["workload"], _problem_order(r["problem_id"]), r["position"]))


def _problem_order(problem_id: str) -> tuple:
    head, _, tail = problem_id.rpartition("-") if "-" in problem_id else problem_id.rpartition("/")
    return (head, int(tail)) if tail.isdigit() else (problem_id, 0)


def quality(trace_or_rows: list[dict]) -> dict:
    if not trace_or_rows:
        return {"num_calls": 0, "kl_mean": None, "agreement": None}
    return {"num_calls": len(trace_or_rows), "kl_mean": mean(t["kl"] for t in trace_or_rows),
            "agreement": mean(float(t["agree"]) for t in trace_or_rows)}


def reuse(trace_or_rows: list[dict]) -> float:
    return (sum(t["reused_token_layers"] for t in trace_or_rows)
            / max(sum(t["prompt_token_layers"] for t in trace_or_rows), 1))


def meets(q: dict, config: QualityConfig) -> bool:
    target = config.target
    return q["num_calls"] > 0 and q["kl_mean"] <= target.kl_max and q["agreement"] >= target.agreement_min


def role_report(rows: list[dict], config: QualityConfig) -> dict:
    trace, aggregates = replay_role(rows, config)
    rung_names = [r.name for r in config.ladder]
    static = {}
    for name in rung_names:
        calls = [row["rungs"][name] for row in rows]
        static[name] = {**quality(calls), "quality_after_20": quality(calls[QUALITY_AFTER_CALLS:]),
                        "reuse": reuse(calls)}
        static[name]["meets_target"] = meets(static[name], config)
    meeting = [n for n in rung_names if static[n]["meets_target"]]
    best = max(meeting, key=lambda n: static[n]["reuse"]) if meeting else None
    after = trace[QUALITY_AFTER_CALLS:]
    with_decode = all(t["decode_ms"] is not None for t in trace)
    live_ms = sum(t["prefill_ms"] + (t["decode_ms"] or 0.0) for t in trace)
    shadow_ms = sum(t["shadow_ms"] for t in trace)
    prefill_ms = sum(t["prefill_ms"] for t in trace)
    full_ms = sum(row["rungs"]["full"]["ttft_ms"] for row in rows)
    guard_reuse, guard_reuse_after = reuse(trace), reuse(after)
    report = {
        "num_calls": len(trace), "num_shadowed": sum(t["shadow"] for t in trace),
        "guard_num_samples": aggregates["num_samples"],  # what the guard was fed: the shadowed calls only
        "quality_all": quality(trace), "quality_after_20": quality(after),
        "meets_target_after_20": meets(quality(after), config) if after else None,
        "reuse": guard_reuse, "reuse_after_20": guard_reuse_after,
        "best_static": best, "best_static_reuse": static[best]["reuse"] if best else None,
        "reuse_vs_best_static": guard_reuse / static[best]["reuse"] if best and static[best]["reuse"] else None,
        "reuse_after_20_vs_best_static": (reuse(after) / reuse([row["rungs"][best] for row in rows][
            QUALITY_AFTER_CALLS:]) if best and after else None),
        "shadow_share": shadow_ms / (live_ms + shadow_ms) if with_decode and live_ms + shadow_ms else None,
        # past the first calls only the sample rate's share is shadowed: what the references cost in a long run
        "shadow_share_at_sample_rate": (config.sample_rate * full_ms / (live_ms + config.sample_rate * full_ms)
                                        if with_decode else None),
        "shadow_share_prefill_only": shadow_ms / (prefill_ms + shadow_ms) if prefill_ms + shadow_ms else 0.0,
        "rung_calls": {n: sum(t["rung"] == n for t in trace) for n in rung_names},
        "static": static,
        # per call: [rung, shadowed, live KL, top-1 agrees]
        "trace": [[t["rung"], int(t["shadow"]), round(t["kl"], 5), int(t["agree"])] for t in trace],
    }
    report["moves"] = sum(a["rung"] != b["rung"] for a, b in zip(trace, trace[1:], strict=False))
    return report


def plot_role(path: Path, title: str, report: dict, config: QualityConfig) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.name for r in config.ladder]
    trace = [{"rung": r, "shadow": s, "kl": kl} for r, s, kl, _ in report["trace"]]
    xs = list(range(1, len(trace) + 1))
    fig, (ax_rung, ax_kl) = plt.subplots(2, 1, figsize=(8, 4.5), sharex=True)
    ax_rung.step(xs, [names.index(t["rung"]) for t in trace], where="mid", color="tab:blue")
    shadowed = [(x, names.index(t["rung"])) for x, t in zip(xs, trace, strict=True) if t["shadow"]]
    if shadowed:
        ax_rung.scatter([x for x, _ in shadowed], [y for _, y in shadowed], s=12, color="tab:orange",
                        label="shadowed", zorder=3)
        ax_rung.legend(loc="upper right", fontsize=8)
    ax_rung.set_yticks(range(len(names)), names)
    ax_rung.set_ylabel("rung")
    ax_rung.set_title(title)
    ax_kl.plot(xs, [max(t["kl"], 1e-6) for t in trace], marker=".", color="tab:red", lw=0.8)
    ax_kl.axhline(config.target.kl_max, ls="--", color="gray", label="target KL")
    ax_kl.set_yscale("log")
    ax_kl.set_ylabel("first-token KL (live call)")
    ax_kl.set_xlabel("call of the role")
    ax_kl.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=60)
    plt.close(fig)


def calls_path(report_path: str) -> Path:
    """Where the measured rows of a report go: beside it, gzipped."""
    return Path(report_path).with_suffix(".calls.json.gz")


def workload_offsets(workloads: list[str], offset: int | None) -> dict[str, int]:
    """Each workload's first problem: ``offset`` when given, else the default for that workload."""
    return {w: offset if offset is not None else WORKLOAD_OFFSETS.get(w, 0) for w in workloads}


def problem_range(rows: list[dict]) -> dict[str, list[str]]:
    """Per workload, the first and the last problem of the rows (in the order measured)."""
    ids: dict[str, list[str]] = {}
    for row in rows:
        ids.setdefault(row["workload"], []).append(row["problem_id"])
    return {w: [got[0], got[-1]] for w, got in ids.items()}


def measure(args: argparse.Namespace, config: QualityConfig) -> tuple[list[dict], dict[str, dict]]:
    """The rows of every call, and what each rung's method resolved for the model (e.g. relay's layers and selector
    from the model's profile, as the server resolves them), so the report says which profile was measured."""
    from quality_measure import measure_workload

    from kvrelay.reuse import get_method
    from kvrelay.weights.loader import load_model

    lm = load_model(args.model)
    specs = {r.name: r.method_spec for r in config.ladder}
    settings = {name: get_method(spec).settings(lm) for name, spec in specs.items()}
    rows: list[dict] = []

    def checkpoint(workload_rows: list[dict]) -> None:  # keep what is measured so far
        if args.json:
            write_json_gz(calls_path(args.json), rows + workload_rows)

    workloads = args.workloads.split(",")
    for workload, offset in workload_offsets(workloads, args.offset).items():
        rows += measure_workload(lm, workload, specs, args.limit, offset, checkpoint=checkpoint)
    return rows, settings


def config_from_args(start: str | None, sets: list[str]) -> tuple[QualityConfig, dict]:
    """The default config with ``--start`` (``safest``: None) and each ``--set FIELD=VALUE`` (typed as the field's
    default; a switch from true/false/1/0/yes/no), and the overrides as given."""
    overrides: dict = {}
    defaults = QualityConfig()
    for item in sets:
        name, sep, value = item.partition("=")
        if not sep or not hasattr(defaults, name):
            raise SystemExit(f"--set {item!r}: expected FIELD=VALUE with a QualityConfig field")
        kind = type(getattr(defaults, name))
        if kind is bool:
            if value.strip().lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise SystemExit(f"--set {item!r}: {name} is a switch (true or false)")
            overrides[name] = value.strip().lower() in ("true", "1", "yes")
        else:
            overrides[name] = kind(value)
    return dataclasses.replace(defaults, start=None if start == "safest" else start, **overrides), overrides


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--workloads", default=",".join(WORKLOAD_OFFSETS))
    p.add_argument("--limit", type=int, default=40, help="problems per workload")
    p.add_argument("--offset", type=int, help="first problem of every workload (default: per workload, "
                                              f"{WORKLOAD_OFFSETS})")
    p.add_argument("--calls-json", help="replay rows measured earlier instead of measuring")
    p.add_argument("--bench-json", help="replay the per-call rows of these kvrelay bench JSON files (comma-separated)")
    p.add_argument("--rung-method", action="append", default=[],
                   help="with --bench-json: RUNG=METHOD, the bench's method name for a rung (default: its spec)")
    p.add_argument("--start", default=QualityConfig().start,
                   help="rung a role starts at ('safest': the ladder's last; default: the config's)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="another value of a QualityConfig number or switch (e.g. trust_start=false)")
    p.add_argument("--json", help="write the report here (and the measured rows beside it, .calls.json.gz)")
    p.add_argument("--plots", help="folder for one PNG per role")
    args = p.parse_args(argv)
    config, overrides = config_from_args(args.start, args.set)
    rung_settings = None  # a replay of --calls-json has no model and no record of what its rungs resolved
    if args.bench_json:
        rung_methods = {r.name: r.method_spec for r in config.ladder}
        rung_methods.update(item.split("=", 1) for item in args.rung_method)
        rows = rows_from_bench(args.bench_json.split(","), rung_methods)
        rung_settings = bench_rung_settings(args.bench_json.split(","), rung_methods)
    elif args.calls_json:
        rows = read_json(Path(args.calls_json))
    else:
        rows, rung_settings = measure(args, config)
    roles: dict[str, list[dict]] = {}
    for row in rows:
        roles.setdefault(f"{row['workload']}/{row['agent']}", []).append(row)
    reports = {key: role_report(role_rows, config) for key, role_rows in roles.items()}
    for key, rep in reports.items():
        after, best = rep["quality_after_20"], rep["best_static"]
        print(f"{key}: calls {rep['num_calls']} shadowed {rep['num_shadowed']} moves {rep['moves']} "
              f"rungs {rep['rung_calls']} | after 20: KL {after['kl_mean']} agree {after['agreement']} "
              f"meets {rep['meets_target_after_20']} | reuse {rep['reuse']:.3f} (after 20 {rep['reuse_after_20']:.3f})"
              f" best static {best} {rep['best_static_reuse']} ratio {rep['reuse_vs_best_static']} "
              f"(after 20 {rep['reuse_after_20_vs_best_static']}) | shadow share {rep['shadow_share']} "
              f"(prefill only {rep['shadow_share_prefill_only']:.3f}; "
              f"at the sample rate {rep['shadow_share_at_sample_rate']})")
        if args.plots:
            plot_role(Path(args.plots) / f"{key.replace('/', '-')}.png", f"{args.model} {key}", rep, config)
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
        out = {"env": {"machine": platform.machine(), "cpu_threads": os.environ.get("OMP_NUM_THREADS"),
                       "commit": commit.strip(), "python": sys.version.split()[0]},
               "model": args.model, "limit": args.limit,
               "workload_offsets": workload_offsets(sorted({r["workload"] for r in rows}), args.offset),
               "problem_ids": problem_range(rows), "rung_settings": rung_settings,
               "sources": args.bench_json.split(",") if args.bench_json else args.calls_json,
               "overrides": overrides,
               "config": {"target": str(config.target), "sample_rate": config.sample_rate,
                          "first_calls_per_role": config.first_calls_per_role,
                          "ladder": [dataclasses.asdict(r) for r in config.ladder], "start": config.start},
               "roles": reports}
        Path(args.json).write_text(json.dumps(out, separators=(",", ":")))


if __name__ == "__main__":
    main()
