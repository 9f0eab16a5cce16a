"""Loads read in place against loads copied, on one downstream call: load + prefill, then decode steps.

    OMP_NUM_THREADS=2 python benchmarks/load_in_place.py --workload copy-agents:5 --agent agent5

Runs one problem's reference pipeline with ``full``; at the chosen agent's call, plans ``--method``, then,
interleaved ``--repeats`` times, loads the plan's spans into a fresh sequence cache either copied when loaded
(``cache.kv.IN_PLACE_MIN_TOKENS`` out of reach) or read in place (the shipped rule), runs the scheduled
prefill and ``--steps`` greedy decode steps, and prints the medians of each part and the bytes of K/V the
loads copied before the first token.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvrelay.cache import kv
from kvrelay.cache.kv import SequenceKV
from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine
from kvrelay.pipeline.runner import PipelineRunner
from kvrelay.pipeline.workloads import get_workload
from kvrelay.reuse import get_method
from kvrelay.weights.loader import DEFAULT_MODEL, load_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--workload", default="copy-agents:5")
    parser.add_argument("--problem", type=int, default=0)
    parser.add_argument("--agent", default="agent5")
    parser.add_argument("--method", default="naive")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    lm = load_model(args.model)
    wl = get_workload(args.workload)
    problem = wl.problems(None, args.problem + 1)[args.problem]
    method = get_method(args.method)
    engine = Engine(lm, KVStore(4 << 30), methods=("full", method))
    shipped_rule = kv.IN_PLACE_MIN_TOKENS

    def run(call, rule: int) -> tuple[list[float], int]:
        kv.IN_PLACE_MIN_TOKENS = rule
        ids = torch.tensor(call.prompt_ids)
        plan = method.plan(call, engine.store, lm)
        cache = SequenceKV(lm.config, lm.model.dtype, lm.model.device, capacity=len(ids) + args.steps + 1)
        t0 = time.perf_counter()
        for load in plan.loads:
            cache.load_span(plan.span_of(load, engine.store), load.dst_start, lm.model.rope, load.src_start,
                            load.src_end)
        copied = sum(load.num_tokens for load in plan.loads) - sum(r.num_tokens for r in cache._refs)
        token = int(lm.model.prefill(ids, cache, plan.schedule).logits.argmax())
        times = [time.perf_counter()]
        for _ in range(args.steps):
            token = int(lm.model.decode_step(token, cache).argmax())
            times.append(time.perf_counter())
        kv.IN_PLACE_MIN_TOKENS = shipped_rule
        starts = [t0, *times[:-1]]
        token_bytes = 2 * lm.config.num_layers * lm.config.num_kv_heads * lm.config.head_dim * cache.dtype.itemsize
        return [(b - a) * 1e3 for a, b in zip(starts, times, strict=True)], copied * token_bytes

    def probe(agent, call, position) -> None:
        if agent.name != args.agent:
            return
        rules = {"copied": 10**9, "in place": shipped_rule}
        parts: dict[str, list[list[float]]] = {name: [] for name in rules}
        copied_bytes = {}
        for _ in range(args.repeats):  # interleaved: machine noise hits both alike
            for name, rule in rules.items():
                ms, copied_bytes[name] = run(call, rule)
                parts[name].append(ms)
        labels = ["load + prefill", *(f"decode step {i + 1}" for i in range(args.steps))]
        print(f"{args.workload} {problem.problem_id} {agent.name} ({len(call.prompt_ids)} tokens), {args.method}, "
              f"medians of {args.repeats}:")
        for name in rules:
            cols = ", ".join(f"{label} {statistics.median(r[i] for r in parts[name]):.1f} ms"
                             for i, label in enumerate(labels))
            print(f"  {name}: {cols}; K/V copied before the first token {copied_bytes[name] / 1e6:.1f} MB")

    PipelineRunner(engine, wl.spec, run_id=problem.problem_id).run(problem.inputs, "full", before_call=probe)


if __name__ == "__main__":
    main()
