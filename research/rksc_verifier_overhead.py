"""Where a rksc verification's time goes: one verifier prompt, the exit test and the attention probe
turned off one at a time, against a contiguous root copy + one SDPA (what ``prefix`` does) and ``full``.

    OMP_NUM_THREADS=1 .venv/bin/python research/rksc_verifier_overhead.py --repeats 9 \
        --json benchmarks/results/rksc-verifier-overhead.json

Variants run interleaved within each repeat (machine noise hits them alike); medians are reported.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvrelay.branches.prompts import BranchConfig, BranchPrompts
from kvrelay.branches.rksc import RKSCMethod, SharedRoot
from kvrelay.cache.kv import SequenceKV
from kvrelay.data.datasets import load_gsm8k
from kvrelay.engine import Engine, GenerateOptions
from kvrelay.eval.harness import environment
from kvrelay.eval.stats import median
from kvrelay.model.sampling import SamplingConfig
from kvrelay.model.schedule import SuffixSchedule
from kvrelay.weights.loader import DEFAULT_MODEL, load_model

# a plausible 64-token branch output (the timing does not depend on its content)
OUTPUT = ("Janet's ducks lay 16 eggs per day. She eats 3 and bakes with 4, so 16 - 3 - 4 = 9 eggs remain. "
          "She sells 9 eggs at $2 each, so she makes 9 x 2 = 18 dollars every day. Answer: 18")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    lm = load_model(args.model)
    problem = load_gsm8k(None, limit=1)[0]
    prompts = BranchPrompts.build(lm.tokenizer, problem.question, BranchConfig())
    ids = prompts.verifier_ids(lm.tokenizer.encode(OUTPUT)[:64])
    root_len = len(prompts.root_ids)
    root = SequenceKV(lm.config, lm.model.dtype, lm.model.device, capacity=root_len)
    lm.model.prefill(torch.tensor(prompts.root_ids), root)

    def rksc(exit_entropy_nats: float = 0.0, probe_attention: bool = True):
        method = RKSCMethod(exit_entropy_nats=exit_entropy_nats)
        method.probe_attention = probe_attention  # RSBCM's importance probe, always on in the product
        method.root, method.exiting = SharedRoot(tuple(prompts.root_ids), root), True
        return lambda: Engine(lm).generate(ids, method, GenerateOptions(SamplingConfig(max_new_tokens=1)))

    def contiguous():
        cache = SequenceKV(lm.config, lm.model.dtype, lm.model.device, capacity=len(ids) + 1)
        cache.k[:, :, :root_len], cache.v[:, :, :root_len] = root.k[:, :, :root_len], root.v[:, :, :root_len]
        cache.filled[:, :root_len] = True
        lm.model.prefill(torch.tensor(ids), cache, SuffixSchedule(root_len))

    variants = {
        "rksc (defaults: attention probe, no layer exit)": rksc(),
        "rksc[exit_entropy_nats=0.25] (exit test in the last sixth of the layers)": rksc(0.25),
        "rksc, no attention probe": rksc(probe_attention=False),
        "rksc[exit_entropy_nats=0.25], no attention probe": rksc(0.25, probe_attention=False),
        "root copied into a contiguous cache + one SDPA (as prefix)": contiguous,
        "full prefill": lambda: Engine(lm).generate(ids, "full", GenerateOptions(SamplingConfig(max_new_tokens=1))),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.repeats + 1):  # the first round warms up and is dropped
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    result = {"env": environment("cpu"), "model": lm.name, "prompt_tokens": len(ids), "root_tokens": root_len,
              "repeats": args.repeats, "ms_median": {k: median(v[1:]) for k, v in times.items()}}
    for name, ms in result["ms_median"].items():
        print(f"{ms:8.1f} ms  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
