"""Behaviour snapshot: every shipped method's reuse and fidelity on a fixed set of calls, and a comparison of two.

    python benchmarks/behaviour_snapshot.py --out SNAPSHOT.json [--limit 10] [--models ...] [--workloads ...]
    python benchmarks/behaviour_snapshot.py --compare BEFORE.json AFTER.json

A restructure must not change what a method does. The snapshot runs each workload's reference pipeline with
``full`` (as ``kvrelay bench``'s agent mode does) and, on every downstream call, runs each method on the same prompt
ids against a store holding exactly the upstream spans; it records per call what the method reused (the token and
token-layer counts, the fallback, the plan's note) and how faithful it was (first token, KL of the first-token
distribution against ``full``, the greedy tokens). Greedy decoding, fixed seeds and one torch thread make a run
deterministic on one machine. Stateful methods (kvcomm) keep their state across a workload's
problems and learn from each call once, as in the bench.

Decoding dominates a run's time on a CPU, so by default each agent of the reference pipeline generates at most
64 tokens (``--max-upstream-tokens``; the spans are shorter than the bench's, the calls otherwise the same) and
16 greedy tokens are recorded per method and call; every method still reuses decode KV, and a change anywhere in
the forward shows in the counts, the first token's distribution or the greedy tokens. Problems run in turn across
the lanes (model x workload) and the snapshot is rewritten after each, so a run stopped early is a smaller
snapshot of every lane; compare two snapshots taken with the same settings.

``--compare`` reports, per method and field, how many calls differ and by how much, and exits 1 past the
tolerances: token ids, counts, fallbacks and notes must be equal; KL may move by float rounding (``KL_ATOL``,
``KL_RTOL``), because a changed kernel or summation order moves fp32 logits by a few ulps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine, GenerateOptions
from kvrelay.eval.fidelity import first_token_agrees, greedy_match, kl_first_token
from kvrelay.eval.harness import environment
from kvrelay.model.lm import LoadedModel
from kvrelay.model.sampling import SamplingConfig
from kvrelay.pipeline.runner import PipelineRunner
from kvrelay.pipeline.spec import PipelineSpec
from kvrelay.pipeline.workloads import get_workload
from kvrelay.reuse import CallInput, ReuseMethod, get_method, split_method_specs
from kvrelay.weights.loader import load_model

#: every pipeline method of the registry at its default settings (``rksc`` plans branches, not pipeline calls)
METHODS = ("full", "prefix", "naive", "cacheblend", "epic", "relay", "kvcomm")
MODELS = ("smollm2-135m", "gemma3-270m")
WORKLOADS = ("gsm8k-chain3", "humaneval-adr")
KEY = ("model", "workload", "problem_id", "agent", "method")
#: must be equal call by call: what was reused, and every token the method chose
EXACT = ("num_prompt_tokens", "num_reused_tokens", "num_computed_token_layers", "num_reused_token_layers",
         "num_recomputed_token_layers", "num_shifted_tokens", "reuse_rate", "fallback", "note", "exit_layer",
         "first_token_id", "first_token_agree", "greedy_ids", "greedy_match")
# KL(full || method) of the first token, in nats, float64 from fp32 logits. A changed kernel or reduction order
# moves each fp32 logit by ~1e-6 (a few ulps of values near 10, summed over hundreds of products), and KL moves by
# about the mean logit change under p, so 1e-5 nats absolute covers exact-reuse methods (KL ~ 1e-12) and a relative
# 1e-3 covers approximate ones (KL up to ~1 nat: a 1e-3 change there is 1e-3 nats, far below any method's effect).
KL_ATOL = 1e-5
KL_RTOL = 1e-3


def probe_call(lm: LoadedModel, engine: Engine, methods: dict[str, ReuseMethod], call: CallInput,
               greedy_tokens: int) -> list[dict]:
    """Each method on one downstream call: its reuse counts and its fidelity against ``full``."""
    outs = {m: engine.generate(call, meth, GenerateOptions(SamplingConfig(greedy_tokens), learn=False))
            for m, meth in methods.items()}
    for meth in methods.values():  # stateful methods learn from the call once, after every method planned it
        if meth.stateful:
            engine.generate(call, meth, GenerateOptions(SamplingConfig(max_new_tokens=1), learn=True))
    ref = outs["full"]
    rows = []
    for m, out in outs.items():
        s = out.stats
        rows.append({
            "method": m, "num_prompt_tokens": s.num_prompt_tokens, "num_reused_tokens": s.num_reused_tokens,
            "num_computed_token_layers": s.num_computed_token_layers,
            "num_reused_token_layers": s.num_reused_token_layers,
            "num_recomputed_token_layers": s.num_recomputed_token_layers,
            "num_shifted_tokens": s.num_shifted_tokens, "reuse_rate": s.reuse_rate, "fallback": s.fallback,
            "note": s.note, "exit_layer": s.exit_layer, "first_token_id": int(out.first_logits.argmax()),
            "first_token_agree": first_token_agrees(ref.first_logits, out.first_logits),
            "kl_first_token": kl_first_token(ref.first_logits, out.first_logits),
            "greedy_ids": list(out.output_ids[:greedy_tokens]),
            "greedy_match": greedy_match(ref.output_ids, out.output_ids, greedy_tokens)})
    return rows


@dataclass
class Lane:
    """One model on one workload; its method objects keep their state across the lane's problems."""

    lm: LoadedModel
    workload: str
    spec: PipelineSpec
    problems: list
    methods: dict[str, ReuseMethod]


def open_lane(lm: LoadedModel, workload_name: str, method_specs: tuple[str, ...], limit: int,
              max_upstream_tokens: int | None) -> Lane:
    """A lane whose agents generate at most ``max_upstream_tokens`` each (None: the workload's own budgets)."""
    workload = get_workload(workload_name)
    spec = workload.spec
    if max_upstream_tokens is not None:
        spec = dataclasses.replace(spec, agents=tuple(
            dataclasses.replace(a, max_new_tokens=min(a.max_new_tokens, max_upstream_tokens)) for a in spec.agents))
    return Lane(lm, workload_name, spec, workload.problems(None, limit), {m: get_method(m) for m in method_specs})


def snapshot_problem(lane: Lane, problem, greedy_tokens: int, store_bytes: int) -> list[dict]:
    """Every downstream call of one problem, each method on it."""
    engine = Engine(lane.lm, KVStore(store_bytes), lane.methods.values())
    rows: list[dict] = []

    def probe(agent, call: CallInput, position: int) -> None:
        if call.refs:  # a downstream call: it has something to reuse
            for row in probe_call(lane.lm, engine, lane.methods, call, greedy_tokens):
                rows.append({"model": lane.lm.name, "workload": lane.workload, "problem_id": problem.problem_id,
                             "agent": agent.name, "position": position, **row})

    PipelineRunner(engine, lane.spec, run_id=problem.problem_id).run(problem.inputs, "full", before_call=probe)
    return rows


def write_snapshot(path: str, result: dict) -> None:
    """One call per line: small, and a diff of two snapshots reads call by call."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    body = ",\n".join(json.dumps(r, separators=(",", ":")) for r in result["calls"])
    head = json.dumps({k: v for k, v in result.items() if k != "calls"}, indent=1)[:-2]
    Path(path).write_text(f'{head},\n "calls": [\n{body}\n]}}\n')


def record(args: argparse.Namespace) -> int:
    """Problem by problem across the lanes, rewriting the snapshot after each: a run stopped early keeps the
    problems it finished in every lane (``num_problems`` says how many)."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    lanes = []
    for model in args.models:
        lm = load_model(model)
        lanes += [open_lane(lm, w, args.methods, args.limit, args.max_upstream_tokens) for w in args.workloads]
    result = {"env": environment("cpu"), "torch_threads": torch.get_num_threads(),
              "config": {"methods": list(args.methods), "models": list(args.models),
                         "workloads": list(args.workloads), "limit": args.limit, "greedy_tokens": args.greedy_tokens,
                         "max_upstream_tokens": args.max_upstream_tokens},
              "num_problems": 0, "method_settings": {}, "calls": []}
    for i in range(args.limit):
        for lane in lanes:
            if i < len(lane.problems):
                print(f"{lane.lm.name} {lane.workload} problem {i} ...", file=sys.stderr, flush=True)
                result["calls"] += snapshot_problem(lane, lane.problems[i], args.greedy_tokens, args.store_bytes)
        result["num_problems"] = i + 1
        result["method_settings"] = {f"{lane.lm.name} {lane.workload}": json.loads(json.dumps(
            {m: meth.settings(lane.lm) for m, meth in lane.methods.items()}, default=str)) for lane in lanes}
        write_snapshot(args.out, result)
    print(f"wrote {args.out}: {len(result['calls'])} method-calls", file=sys.stderr)
    return 0


def kl_close(before: float, after: float) -> bool:
    return math.isclose(before, after, rel_tol=KL_RTOL, abs_tol=KL_ATOL)


def field_difference(name: str, before, after) -> float:
    """How far apart one field's two values are: |a - b| for numbers, else 0 (equal) or 1 (differ); for token
    lists, the number of positions from the first that differs to the end of the longer."""
    if name == "greedy_ids":
        n = next((i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b),
                 min(len(before), len(after)))
        return float(max(len(before), len(after)) - n)
    if isinstance(before, (int, float)) and isinstance(after, (int, float)) and not isinstance(before, bool):
        return abs(float(after) - float(before))
    return float(before != after)


def compare_rows(before: list[dict], after: list[dict]) -> tuple[dict, list[str]]:
    """Per method and field: {"calls", "calls_differing", "max_diff"}; and the problems (missing calls, fields past
    tolerance) as lines. Only the problems both snapshots ran are compared (a run stopped early ran fewer)."""
    lanes = ("model", "workload", "problem_id")
    common = {tuple(r[k] for k in lanes) for r in before} & {tuple(r[k] for k in lanes) for r in after}
    index = {tuple(r[k] for k in KEY): r for r in after if tuple(r[k] for k in lanes) in common}
    keyed = {tuple(r[k] for k in KEY): r for r in before if tuple(r[k] for k in lanes) in common}
    problems = [f"call {k} is in only one snapshot" for k in sorted(set(keyed) ^ set(index))]
    table: dict[str, dict[str, dict]] = defaultdict(dict)
    for key in sorted(set(keyed) & set(index)):
        b, a, method = keyed[key], index[key], key[-1]
        for name in (*EXACT, "kl_first_token"):
            cell = table[method].setdefault(name, {"calls": 0, "calls_differing": 0, "max_diff": 0.0})
            cell["calls"] += 1
            if name not in b or name not in a:
                problems.append(f"{key}: field {name} missing in one snapshot")
                continue
            diff = field_difference(name, b[name], a[name])
            cell["max_diff"] = max(cell["max_diff"], diff)
            ok = kl_close(b[name], a[name]) if name == "kl_first_token" else b[name] == a[name]
            if diff:
                cell["calls_differing"] += 1
            if not ok:
                problems.append(f"{key}: {name} {b[name]!r} -> {a[name]!r}")
    return dict(table), problems


def settings_changes(before: dict, after: dict) -> list[str]:
    """Resolved settings (e.g. relay's layers from a model's profile) that differ, as lines."""
    out = []
    for run in sorted(set(before) & set(after)):  # lanes both ran
        b, a = before.get(run, {}), after.get(run, {})
        out += [f"{run} {m}: {b.get(m)} -> {a.get(m)}" for m in sorted(set(b) | set(a)) if b.get(m) != a.get(m)]
    return out


def compare(args: argparse.Namespace) -> int:
    before, after = (json.loads(Path(p).read_text()) for p in args.compare)
    # a method one snapshot did not run (one that left the registry) is named, not compared
    only_one = sorted({r["method"] for r in before["calls"]} ^ {r["method"] for r in after["calls"]})
    if only_one:
        print(f"not compared (run in one snapshot only): {', '.join(only_one)}")
        before["calls"], after["calls"] = ([r for r in s["calls"] if r["method"] not in only_one]
                                           for s in (before, after))
    table, problems = compare_rows(before["calls"], after["calls"])
    compared_problems = {(r["model"], r["workload"], r["problem_id"]) for r in before["calls"]} & {
        (r["model"], r["workload"], r["problem_id"]) for r in after["calls"]}
    print(f"before: {args.compare[0]} (commit {before['env'].get('commit')}), "
          f"after: {args.compare[1]} (commit {after['env'].get('commit')})")
    settings = ("methods", "models", "workloads", "greedy_tokens", "max_upstream_tokens")
    if any(before["config"].get(k) != after["config"].get(k) for k in settings):
        print(f"warning: the snapshots were taken with other settings: {before['config']} vs {after['config']}")
    print(f"compared {len(compared_problems)} problems (model, workload, problem) that both ran")
    if not compared_problems:
        print("nothing to compare: the snapshots share no problem")
        return 1
    print(f"tolerances: exact for {', '.join(EXACT)}; kl_first_token within {KL_ATOL:g} nats + {KL_RTOL:g} x KL")
    print("| method | field | calls | calls differing | max difference |\n|---|---|---|---|---|")
    for method, fields in table.items():
        for name, cell in fields.items():
            if cell["calls_differing"] or name in ("kl_first_token", "greedy_ids"):
                print(f"| {method} | {name} | {cell['calls']} | {cell['calls_differing']} | {cell['max_diff']:.3g} |")
    for line in settings_changes(before.get("method_settings", {}), after.get("method_settings", {})):
        print(f"resolved settings differ (not failing): {line}")
    if problems:
        print(f"\n{len(problems)} difference(s) past tolerance:")
        print("\n".join(problems[: args.max_lines]))
        if len(problems) > args.max_lines:
            print(f"... and {len(problems) - args.max_lines} more")
        return 1
    print("\nbehaviour unchanged within tolerance")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--out", help="record a snapshot to this JSON file")
    what.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two snapshots")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated method specs")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--limit", type=int, default=10, help="problems per workload")
    parser.add_argument("--greedy-tokens", type=int, default=16, help="greedy tokens recorded per method and call")
    parser.add_argument("--max-upstream-tokens", type=int, default=64,
                        help="cap on each agent's generated tokens in the reference pipeline (0: the workload's own)")
    parser.add_argument("--store-bytes", type=int, default=4 << 30)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: deterministic; more changes summation order, a rounding check)")
    parser.add_argument("--max-lines", type=int, default=40, help="differences printed at most")
    args = parser.parse_args(argv)
    if args.compare:
        return compare(args)
    args.methods = split_method_specs(args.methods)
    args.models, args.workloads = (tuple(s.strip() for s in v.split(",") if s.strip())
                                   for v in (args.models, args.workloads))
    if "full" not in args.methods:
        parser.error("--methods must include full (fidelity is measured against it)")
    if args.limit < 1 or args.greedy_tokens < 1 or args.threads < 1 or args.max_upstream_tokens < 0:
        parser.error("--limit, --greedy-tokens and --threads must be >= 1, --max-upstream-tokens >= 0")
    args.max_upstream_tokens = args.max_upstream_tokens or None
    return record(args)


if __name__ == "__main__":
    sys.exit(main())
