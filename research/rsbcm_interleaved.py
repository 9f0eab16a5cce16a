"""RSBCM vs LRU when several problems' requests interleave, as in a server.

Runs ``rksc`` alone on GSM8K test problems (its block cache records every lookup, insert,
importance credit and pin), cuts the trace per problem, and replays it with 1, 2, 4 and 8 problems
in flight (``blocks.interleave``: round-robin, one event each) under several byte budgets. A
problem's accesses do not depend on what the cache holds, so one sequential run gives every order.

    OMP_NUM_THREADS=1 .venv/bin/python research/rsbcm_interleaved.py --limit 50 \
        --json benchmarks/results/rksc-rsbcm-interleaved.json

With ``--few-shot K`` every problem's system prompt carries K worked GSM8K *train* examples, a deep
prefix shared across problems; ``--families F --family-run R`` gives F different example sets, problem
i using set (i // R) % F (two applications' templates taking turns), so a set's prefix sits unpinned
while the other set's problems fill the cache:

    OMP_NUM_THREADS=1 .venv/bin/python research/rsbcm_interleaved.py --limit 16 --few-shot 4 \
        --families 2 --family-run 4 --budgets-mb 48,96 --json benchmarks/results/rksc-rsbcm-fewshot.json
"""

from __future__ import annotations

import argparse
import json
import sys

from tqdm import tqdm

from kvrelay.branches.prompts import BranchConfig, few_shot_system
from kvrelay.branches.rksc import RKSCMethod
from kvrelay.branches.runner import BranchRunner
from kvrelay.data.datasets import load_gsm8k
from kvrelay.eval.branch_bench import _working_set, replay_table
from kvrelay.eval.harness import environment
from kvrelay.weights.loader import DEFAULT_MODEL, load_model


def compact_trace(events: list[tuple]) -> list[list]:
    """The trace with block keys as small ints (first-seen order), so it can be replayed again later."""
    ids: dict[bytes, int] = {}
    out = []
    for event in events:
        keys = [ids.setdefault(k, len(ids)) for k in event[1]]
        out.append([event[0], keys, *(x if isinstance(x, bool) else list(x) for x in event[2:])])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--limit", type=int, default=50)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--budgets-mb", default="8,24,64")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--half-lives-ops", default="20,100", help="RSBCM importance half-lives to replay too")
    ap.add_argument("--few-shot", type=int, default=0, help="worked train examples in every system prompt")
    ap.add_argument("--families", type=int, default=1, help="example sets taking turns (with --few-shot)")
    ap.add_argument("--family-run", type=int, default=1, help="problems in a row that use one example set")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.few_shot < 0 or args.families < 1 or args.family_run < 1:
        ap.error("need --few-shot >= 0, --families >= 1 and --family-run >= 1")
    budgets = tuple(float(b) for b in args.budgets_mb.split(","))
    concurrency = tuple(int(c) for c in args.concurrency.split(","))
    half_lives = tuple(float(h) for h in args.half_lives_ops.split(",") if h)
    lm = load_model(args.model)
    env = environment("cpu")
    runner = BranchRunner(lm, BranchConfig(), RKSCMethod())
    segments = []
    problems = load_gsm8k(None, limit=args.offset + args.limit)[args.offset:]
    examples = load_gsm8k(None, split="train", limit=args.few_shot * args.families)
    systems = [few_shot_system(examples[f * args.few_shot : (f + 1) * args.few_shot]) for f in range(args.families)]
    family_of = [(i // args.family_run) % args.families for i in range(len(problems))]
    for p, f in tqdm(list(zip(problems, family_of, strict=True)), desc="rksc trace", unit="problem", file=sys.stderr):
        start = len(runner.blocks.events)
        runner.run(p.question, "rksc", systems[f])
        segments.append((start, len(runner.blocks.events)))
    events, block_len = runner.blocks.events, runner.blocks.block_len
    rows = replay_table(events, segments, budgets, concurrency, block_len, half_lives)
    per_problem = [_working_set(events[a:b])["total_bytes"] for a, b in segments]
    result = {"env": env, "model": lm.name, "n": len(problems), "offset": args.offset, "block_len": block_len,
              "few_shot": args.few_shot, "families": args.families, "family_run": args.family_run,
              "family_of_problem": family_of,
              "system_prompt_tokens": [len(lm.tokenizer.encode(s)) for s in systems],
              "working_set_bytes": _working_set(events), "problem_working_set_mb_mean":
              sum(per_problem) / len(per_problem) / 2**20, "replay": rows,
              "trace": compact_trace(events), "segments": segments}
    print(f"{len(problems)} problems; distinct blocks per problem {result['problem_working_set_mb_mean']:.1f} MiB")
    print(f"{'in flight':>9s} {'budget MiB':>10s} {'policy':>6s} {'half-life':>9s} {'hit rate':>9s} "
          f"{'recomputed tok':>15s} {'rejected':>8s}")
    for r in rows:
        print(f"{r['concurrency']:9d} {r['budget_mb']:10.0f} {r['policy']:>6s} {r['half_life_ops']:9.0f} "
              f"{r['hit_rate']:9.3f} {r['num_recomputed_tokens']:15d} {r['num_rejected_blocks']:8d}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
