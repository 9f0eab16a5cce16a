"""How far could relay's token selection carry full's continuation? The oracle selection held to full's greedy path.

``relay_oracle.py`` scores its oracle (the span tokens whose keys truly deviate most from a fresh prefill,
recomputed at every layer) on the first token only. Here the same selection runs as a method and is held to
``full``'s first ``--path-tokens`` greedy tokens, teacher-forced, as ``kvrelay profile`` scores relay's
candidates (``kvrelay.eval.calibration_calls.score_methods``): first-token KL, reuse, the KL along the
continuation and the greedy@N share, beside ``epic`` and the profile's ``relay``. No real method can know the
oracle's ranking before computing the fresh K/V: it indicates what a better ranking by key deviation could
give (a heuristic selection, top tokens by mean key distance, not an upper bound on every selection).

Usage: python benchmarks/relay_path_oracle.py --model smollm2-135m --workload gsm8k-chain3 --offset 100
    --problems 20 --ratios 0.1,0.15,0.2 [--pre 0,8] --json OUT.json
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from relay_oracle import oracle_active
from relay_train_points import calls_parser

from kvrelay.cache.kv import SequenceKV
from kvrelay.cache.store import KVStore
from kvrelay.engine.call import run_plan
from kvrelay.eval.calibration_calls import score_methods
from kvrelay.eval.harness import environment
from kvrelay.model.schedule import Schedule, StaticSchedule
from kvrelay.reuse.base import CallInput, Plan, ReuseMethod
from kvrelay.reuse.epic import EpicMethod
from kvrelay.reuse.relay import RelayMethod
from kvrelay.weights.loader import load_model


class OracleMethod(ReuseMethod):
    """The oracle selection as a method: plans by first running a fresh prefill of the prompt (outside any
    timing; this method is for fidelity only)."""

    name = "oracle"

    def __init__(self, ratio: float, pre: int = 0) -> None:
        self.ratio, self.pre = ratio, pre

    def plan(self, call: CallInput, store: KVStore | None, lm) -> Plan:
        n = len(call.prompt_ids)
        fresh = SequenceKV(lm.config, lm.model.dtype, lm.model.device, capacity=n + 1)
        run_plan(lm, torch.tensor(call.prompt_ids), Plan(Schedule()), fresh, None)  # full's prefill
        active, loads = oracle_active(lm, call, store, fresh, self.ratio, self.pre)
        return Plan(StaticSchedule(active), loads)


def main() -> None:
    ap = calls_parser(__doc__.splitlines()[0], problems=20)
    ap.add_argument("--ratios", default="0.1,0.15,0.2", help="the oracle's shares of span tokens, a comma list")
    ap.add_argument("--pre", default="0", help="span openings the oracle also computes, a comma list")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    oracles = {f"oracle top {r}" + (f" + pre {k}" if k else ""): OracleMethod(r, k)
               for k in (int(x) for x in args.pre.split(",")) for r in (float(x) for x in args.ratios.split(","))}
    methods = {"epic": EpicMethod(), "relay": RelayMethod(), **oracles}
    lm = load_model(args.model)
    scores = score_methods(lm, methods, args.workload, None, args.problems, "oracle", True, args.path_tokens,
                           args.offset)
    out = {"model": lm.name, "workload": args.workload, "offset": args.offset, "problems": args.problems,
           "path_tokens": args.path_tokens, "environment": environment("cpu"),
           "scores": {name: score._asdict() for name, score in scores.items()}}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    epic = scores["epic"]
    for name, score in scores.items():
        print(f"{name:28s} " + " ".join(f"{k}={v:.4f}" for k, v in score._asdict().items() if v is not None)
              + f"  (reuse {score.reuse / epic.reuse:.3f}x, KL {score.kl / epic.kl:.2f}x, "
                f"path KL {score.path_kl / epic.path_kl:.2f}x epic's)")


if __name__ == "__main__":
    main()
