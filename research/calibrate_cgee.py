"""Per-layer entropy and verifier score of gsm8k-branches verification calls, on GSM8K *train*.

Chooses nothing by itself: it prints, for candidate (theta, eps, min_layer) settings of RKSC's
layer exit, how many calls would exit and how many of those would flip their yes/no verdict
against the full-depth forward. Used once to set the defaults in kvrelay/branches/rksc.py.

    OMP_NUM_THREADS=1 .venv/bin/python research/calibrate_cgee.py --problems 8 \
        --json benchmarks/results/rksc-cgee-calibration.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from tqdm import tqdm

from kvrelay.branches.prompts import BranchConfig, BranchPrompts, answer_ids
from kvrelay.branches.rksc import entropy, yes_score
from kvrelay.branches.runner import BranchRunner
from kvrelay.cache.kv import SequenceKV
from kvrelay.data.datasets import load_gsm8k
from kvrelay.model.schedule import Schedule
from kvrelay.weights.loader import DEFAULT_MODEL, load_model


class _Probe(Schedule):
    """Full prefill that records every layer's next-token entropy and yes-score of the last token."""

    has_exit_test = True

    def __init__(self, logits_fn, yes_id: int, no_id: int) -> None:
        self.logits_fn, self.yes_id, self.no_id = logits_fn, yes_id, no_id
        self.curve: list[tuple[float, float]] = []

    def exit_after(self, layer: int, last_hidden: torch.Tensor) -> bool:
        logits = self.logits_fn(last_hidden)
        self.curve.append((entropy(logits), yes_score(logits, self.yes_id, self.no_id)))
        return False


def exit_layer(curve: list[tuple[float, float]], theta: float, eps: float, min_layer: int) -> int | None:
    """The layer RKSC's rule would exit at (same rule as RKSCSchedule.exit_after), or None."""
    for layer in range(max(1, min_layer), len(curve)):
        h, prev = curve[layer][0], curve[layer - 1][0]
        if h < theta and abs(h - prev) < eps:
            return layer
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--problems", type=int, default=8)
    ap.add_argument("--offset", type=int, default=0, help="first train problem")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    lm = load_model(args.model)
    cfg = BranchConfig()
    runner = BranchRunner(lm, cfg)
    yes_id, no_id = answer_ids(lm.tokenizer)
    curves = []
    problems = load_gsm8k(split="train", limit=args.offset + args.problems)[args.offset:]
    for p in tqdm(problems, desc="calibration", unit="problem", file=sys.stderr):
        run = runner.run(p.question, "full")
        prompts = BranchPrompts.build(lm.tokenizer, p.question, cfg)
        for out_ids in run.output_ids:
            probe = _Probe(lm.model.logits_from_hidden, yes_id, no_id)
            ids = prompts.verifier_ids(out_ids)
            cache = SequenceKV(lm.config, lm.model.dtype, lm.model.device, capacity=len(ids))
            lm.model.prefill(torch.tensor(ids), cache, probe)
            curves.append(probe.curve)
    num_layers = lm.config.num_layers
    print("layer  mean entropy  share of calls whose verdict equals the top layer's")
    for layer in range(num_layers):
        agree = sum((c[layer][1] >= 0.5) == (c[-1][1] >= 0.5) for c in curves) / len(curves)
        print(f"{layer:5d}  {sum(c[layer][0] for c in curves) / len(curves):12.3f}  {agree:.3f}")
    rows = []
    for theta in (0.25, 0.5, 1.0, 2.0, 3.0):
        for eps in (0.05, 0.1, 0.3):
            for min_layer in (10, 15, 20, 25):
                exits = [(c, exit_layer(c, theta, eps, min_layer)) for c in curves]
                fired = [(c, e) for c, e in exits if e is not None]
                flips = sum((c[e][1] >= 0.5) != (c[-1][1] >= 0.5) for c, e in fired)
                saved = sum(num_layers - 1 - e for _, e in fired) / (num_layers * len(curves))
                rows.append({"theta": theta, "eps": eps, "min_layer": min_layer, "exit_rate": len(fired) / len(curves),
                             "flip_rate": flips / len(curves), "layers_saved": saved})
    print("\ntheta   eps  min_layer  exit_rate  flip_rate(per call)  layers_saved")
    for r in rows:
        print(f"{r['theta']:5.2f} {r['eps']:5.2f} {r['min_layer']:10d} {r['exit_rate']:10.3f} {r['flip_rate']:20.3f} "
              f"{r['layers_saved']:13.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": lm.name, "split": "train", "problems": args.problems, "offset": args.offset,
                       "curves": curves, "grid": rows}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
