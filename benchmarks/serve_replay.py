"""Replay the refs the server chose (``serve_chain.py --keep-debug`` JSON) in process, beside the runner's.

For each downstream call of gsm8k-chain3 the reference pipeline runs with `full` in process (the
same prompt ids as over HTTP, checked); every method then runs the call twice on the same stored
spans: with the pipeline runner's refs and with the server's refs. Equal numbers for the server's
refs here and over HTTP rule out the serving path itself (positions, hidden states, namespaces);
a difference between the two ref sets is the matching's.

The server's span ids are "span-<origin>-<k>-p<n>": the chain publishes only the `full` calls (the
probes are not cached), so span k of a chain is agent k % 3.

    OMP_NUM_THREADS=1 python benchmarks/serve_replay.py benchmarks/results/serve-chain-gap-longest-contents.json \\
        --methods "relay;relay[l_pre=4];epic" --limit 10 --json OUT
"""

from __future__ import annotations

import argparse
import json
import statistics

from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine
from kvrelay.eval.fidelity import kl_first_token
from kvrelay.pipeline.runner import PipelineRunner
from kvrelay.pipeline.workloads import get_workload
from kvrelay.reuse import CallInput, SpanRef
from kvrelay.weights.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("http_json", help="serve_chain.py output written with --keep-debug")
    ap.add_argument("--methods", default="relay;epic", help="method specs separated by ';'")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    http = json.load(open(args.http_json))
    methods = [m for m in args.methods.split(";") if m]
    lm = load_model(http["model"], progress=False)
    wl = get_workload("gsm8k-chain3")
    served = {(c["problem_id"], c["agent"]): c for c in http["calls"]}
    rows: list[dict] = []
    for problem in wl.problems(None, args.limit):
        engine = Engine(lm, KVStore(4 << 30), methods=("full", *methods))

        def probe(agent, call, position, problem=problem, engine=engine):
            if position == 0:
                return
            c = served[(problem.problem_id, agent.name)]
            if c["full_prompt_ids"] != call.prompt_ids:
                raise SystemExit(f"{problem.problem_id} {agent.name}: the server's prompt ids differ from the runner's")

            def span_of(server_id: str) -> str:
                return f"{problem.problem_id}/{wl.spec.order[int(server_id.split('-')[2]) % len(wl.spec.order)]}"

            server_call = CallInput(call.prompt_ids, [
                SpanRef(r["start"], r["end"], span_of(r["span_id"]), r["src_start"], r["kind"], r["name"])
                for r in c["refs"]], call.name, call.role)
            full = engine.generate(call, "full").first_logits
            for method in methods:
                for refs, ci in (("runner", call), ("server", server_call)):
                    out = engine.generate(ci, method)
                    kl = kl_first_token(full, out.first_logits)
                    rows.append({"problem_id": problem.problem_id, "agent": agent.name, "method": method, "refs": refs,
                                 "reuse_rate": out.stats.reuse_rate, "kl_first_token": kl,
                                 "first_token_agree": int(full.argmax()) == int(out.first_logits.argmax())})

        PipelineRunner(engine, wl.spec, run_id=problem.problem_id).run(problem.inputs, "full", before_call=probe)
    summary = []
    for method in methods:
        for refs in ("runner", "server"):
            for agent in ("critic", "finalizer", None):
                mine = [r for r in rows if r["method"] == method and r["refs"] == refs and agent in (None, r["agent"])]
                s = {"method": method, "refs": refs, "agent": agent or "all", "n_calls": len(mine),
                     "reuse_rate_mean": statistics.mean(r["reuse_rate"] for r in mine),
                     "kl_first_token": statistics.mean(r["kl_first_token"] for r in mine),
                     "first_token_agreement": statistics.mean(r["first_token_agree"] for r in mine)}
                summary.append(s)
                print(f"{method:40s} {refs:6s} {s['agent']:9s} reuse {s['reuse_rate_mean']:.3f} "
                      f"KL {s['kl_first_token']:.4f} 1st {s['first_token_agreement']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"source": args.http_json, "model": lm.name, "summary": summary, "calls": rows}, f, indent=1)


if __name__ == "__main__":
    main()
