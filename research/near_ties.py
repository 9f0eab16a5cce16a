"""`full`'s first-token margin on every downstream call of a workload, for runs made before the bench
recorded it (``full_first_margin``).

The bench's agent mode runs the reference pipeline with `full` (greedy), so the downstream calls are the
same ids in every run; this script runs that pipeline again and records, per call, the probability of
`full`'s top-1 first token minus its top-2's. ``make_tables.py`` joins it with a run's per-call rows to
count first-token flips on near-ties (margin < ``NEAR_TIE_MARGIN``) apart from flips on clear calls.

Usage: python research/near_ties.py --workload gsm8k-chain3 --limit 50 --json results/near-ties-gsm8k-chain3.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine
from kvrelay.errors import ConfigError, KvRelayError
from kvrelay.eval.fidelity import first_token_margin
from kvrelay.eval.harness import environment
from kvrelay.eval.report import NEAR_TIE_MARGIN, is_near_tie
from kvrelay.pipeline.runner import PipelineRunner
from kvrelay.pipeline.workloads import get_workload
from kvrelay.weights.loader import DEFAULT_MODEL, load_model


def margins(workload: str, limit: int, offset: int = 0, data: str | None = None, model: str = DEFAULT_MODEL
            ) -> list[dict]:
    """Per downstream call: `full`'s first-token margin, from the reference pipeline's own calls."""
    lm = load_model(model)
    wl = get_workload(workload)
    problems = wl.problems(data, offset + limit)[offset:]
    if not problems:
        raise ConfigError(f"offset {offset} is past the last problem of {workload!r}")
    rows: list[dict] = []
    for problem in tqdm(problems, desc=workload, unit="problem", file=sys.stderr):
        runner = PipelineRunner(Engine(lm, KVStore(4 << 30)), wl.spec, run_id=problem.problem_id)
        for name, res in runner.run(problem.inputs, "full").items():
            if not res.call.refs:  # not a downstream call: the bench does not probe it
                continue
            logits = res.output.first_logits
            top = torch.softmax(logits.float(), -1).topk(2)
            rows.append({"problem_id": problem.problem_id, "agent": name, "num_prompt_tokens": len(res.call.prompt_ids),
                         "margin": first_token_margin(logits), "top_probs": top.values.tolist(),
                         "top_tokens": [lm.tokenizer.decode([int(t)]) for t in top.indices]})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", required=True)
    ap.add_argument("--limit", type=int, default=50)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--data")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    env = environment("cpu")
    try:
        rows = margins(args.workload, args.limit, args.offset, args.data, args.model)
    except KvRelayError as exc:
        print(f"near_ties: {exc}", file=sys.stderr)
        return 2
    Path(args.json).write_text(json.dumps({"env": env, "workload": args.workload, "model": args.model,
                                           "near_tie_margin": NEAR_TIE_MARGIN, "calls": rows}, indent=1) + "\n")
    near = sum(is_near_tie(r["margin"]) for r in rows)
    print(f"{args.workload}: {near} of {len(rows)} downstream calls are near-ties (margin < {NEAR_TIE_MARGIN})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
