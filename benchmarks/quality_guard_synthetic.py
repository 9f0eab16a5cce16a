"""The quality guard on synthetic quality streams: when a cheaper rung is asked for its certificate, and what it costs.

    OMP_NUM_THREADS=1 python benchmarks/quality_guard_synthetic.py --calls 40,300 \
        --json benchmarks/results/quality-guard-synthetic.json

One role per run, the default config: ``relay`` (the start rung) at a mean first-token KL of 0.005 nats and
agreement 0.995, ``prefix`` exact, ``naive`` at a grid of mean KLs and agreement rates, KL drawn from a gamma law
(shape 1: exponential, a heavy tail; shape 3: the spread of the recorded SmolLM2 ``naive`` rows). Each call draws
every rung's value from a generator seeded by (seed, call), so both arms see the very same traffic. Two arms:

- ``window``: the guard as shipped: a rung the guard moved to keeps its certificate open (every call shadowed, held to
  the unclipped mean KL of the calls it ran) while a full window at its present mean KL and agreement rate could be
  certified;
- ``min_samples``: the same guard asked for the certificate at ``min_samples`` (``certificate_open`` always false),
  the rule whose floor refuses every mean between ~0.019 and ~0.035 nats whatever the samples show.

Per cell and arm: the share of runs whose live calls after the 20th miss the target (mean KL or agreement), the
share of calls at ``naive`` (the reuse the guard takes), and the shadowed calls per run.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from statistics import mean
from unittest import mock

from kvrelay.quality import QualityConfig, QualityGuard
from kvrelay.quality.ladder import LadderController

QUALITY_AFTER_CALLS = 20
NAIVE_KL_NATS = (0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08)
NAIVE_AGREEMENT = (1.0, 0.97, 0.93)
RELAY = (0.005, 0.995)


def run_role(naive_kl: float, naive_agree: float, shape: float, seed: int, num_calls: int) -> dict:
    """One role's calls through a fresh guard: whether it missed the target after call 20, its share of calls at
    naive, its shadowed calls."""
    config = QualityConfig()
    guard = QualityGuard(config)
    kls, agrees, rungs, num_shadowed = [], [], [], 0
    for i in range(num_calls):
        rng = random.Random(f"{seed}/{i}")
        values = {"naive": (rng.gammavariate(shape, naive_kl / shape), rng.random() < naive_agree),
                  "relay": (rng.gammavariate(shape, RELAY[0] / shape), rng.random() < RELAY[1]),
                  "prefix": (0.0, True)}
        rung = guard.rung_for("ns", "role").name
        shadow = guard.should_shadow("ns", "role")
        kl, agree = values[rung]
        if shadow:
            guard.record("ns", "role", rung, kl, agree)
        num_shadowed += shadow
        kls.append(kl)
        agrees.append(agree)
        rungs.append(rung)
    target = config.target
    after_kl, after_agree = mean(kls[QUALITY_AFTER_CALLS:]), mean(agrees[QUALITY_AFTER_CALLS:])
    return {"miss": after_kl > target.kl_max or after_agree < target.agreement_min,
            "naive_share": rungs.count("naive") / num_calls, "num_shadowed": num_shadowed}


def cell(naive_kl: float, naive_agree: float, shape: float, num_seeds: int, num_calls: int) -> dict:
    runs = [run_role(naive_kl, naive_agree, shape, seed, num_calls) for seed in range(num_seeds)]
    return {"miss_share": sum(r["miss"] for r in runs) / num_seeds,
            "naive_share": round(mean(r["naive_share"] for r in runs), 4),
            "shadowed_per_run": round(mean(r["num_shadowed"] for r in runs), 2)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", default="40,300", help="calls per role, comma-separated")
    p.add_argument("--seeds", type=int, default=60)
    p.add_argument("--shapes", default="1,3", help="gamma shapes of the KL noise, comma-separated")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    out = {"relay": {"kl_mean": RELAY[0], "agreement": RELAY[1]}, "seeds": args.seeds, "cells": []}
    for num_calls in (int(n) for n in args.calls.split(",")):
        for shape in (float(k) for k in args.shapes.split(",")):
            for agree in NAIVE_AGREEMENT:
                for kl in NAIVE_KL_NATS:
                    row = {"calls": num_calls, "shape": shape, "naive_kl": kl, "naive_agreement": agree,
                           "window": cell(kl, agree, shape, args.seeds, num_calls)}
                    with mock.patch.object(LadderController, "certificate_open", lambda self, est: False):
                        row["min_samples"] = cell(kl, agree, shape, args.seeds, num_calls)
                    out["cells"].append(row)
                    w, m = row["window"], row["min_samples"]
                    print(f"calls {num_calls} shape {shape:g} naive {kl:.2f} nats agree {agree:.2f} | miss "
                          f"{w['miss_share']:.2f} (at min_samples {m['miss_share']:.2f}) naive share "
                          f"{w['naive_share']:.2f} ({m['naive_share']:.2f}) shadows {w['shadowed_per_run']:.1f} "
                          f"({m['shadowed_per_run']:.1f})")
    if args.json:
        args.json.write_text(json.dumps(out, separators=(",", ":")))


if __name__ == "__main__":
    main()
