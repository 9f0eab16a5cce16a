"""TTFT of reuse methods on one downstream call, interleaved: what relay's pruning costs per layer.

    OMP_NUM_THREADS=1 python benchmarks/relay_call_timing.py --problem 1 --agent finalizer \
        epic relay 'relay[l_det=2,top_r=0.35,l_pre=4,l_suf=0]' 'relay[l_det=2,top_r=0.35,l_pre=4,l_suf=0,prune=0.0]'

Runs one gsm8k-chain3 problem's reference pipeline with ``full``; at the chosen agent's call, times each
method's plan + loads + prefill ``--repeats`` times, interleaved, and prints the median ms and the computed
token-layers. ``prune=0.0`` makes every band layer a selecting one that drops nothing: the difference to the
same spec without ``prune`` is the selecting path's own cost.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvrelay.cache.kv import SequenceKV
from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine
from kvrelay.engine.call import run_plan
from kvrelay.pipeline.runner import PipelineRunner
from kvrelay.pipeline.workloads import get_workload
from kvrelay.reuse import get_method
from kvrelay.weights.loader import DEFAULT_MODEL, load_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="+", help="method specs, e.g. epic relay")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--problem", type=int, default=1, help="index of the gsm8k-chain3 test problem")
    parser.add_argument("--agent", default="finalizer")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    lm = load_model(args.model)
    wl = get_workload("gsm8k-chain3")
    methods = [get_method(s) for s in args.specs]
    problem = wl.problems(None, args.problem + 1)[args.problem]
    engine = Engine(lm, KVStore(4 << 30), methods=("full", *methods))

    def run(method, call) -> tuple[float, int]:
        ids = torch.tensor(call.prompt_ids)
        t0 = time.perf_counter()
        plan = method.plan(call, engine.store, lm)
        cache = SequenceKV(lm.config, lm.model.dtype, lm.model.device, capacity=len(ids) + 1)
        result, _ = run_plan(lm, ids, plan, cache, engine.store)
        return (time.perf_counter() - t0) * 1e3, result.num_computed_token_layers

    def probe(agent, call, position) -> None:
        if agent.name != args.agent:
            return
        times: dict[str, list[float]] = {s: [] for s in args.specs}
        counts: dict[str, int] = {}
        for _ in range(args.repeats):  # interleaved: machine noise hits every method alike
            for spec, method in zip(args.specs, methods, strict=True):
                ms, counts[spec] = run(method, call)
                times[spec].append(ms)
        total = len(call.prompt_ids) * lm.config.num_layers
        for spec in args.specs:
            print(f"{spec}: {statistics.median(times[spec]):.1f} ms, token-layers {counts[spec]} of {total}")

    PipelineRunner(engine, wl.spec, run_id=problem.problem_id).run(problem.inputs, "full", before_call=probe)


if __name__ == "__main__":
    main()
