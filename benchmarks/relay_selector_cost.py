"""What relay's selection costs: relay against the same schedule with its selection fixed in advance.

For every downstream call of a workload (reference pipeline run with `full`), with relay's shipped
profile, times interleaved (median of --repeats):
- `full`;
- `relay`: the band, selecting at L_det from the fresh Q/K/V before that layer's attention and MLP;
- `relay (whole L_det)`: the same, but the detection layer computed whole for every relayed token
  and the selection applied after it (the method as first implemented);
- `static`: relay's own per-layer active sets replayed with no selector (the kept tokens recorded
  from relay's run; no deviation, no influence, no gather of the cached V): what the computed
  token-layers cost by themselves.
Each timing includes planning and loading the reused K/V. Prints the median TTFT speedups over full,
the ratio relay / static (issue target >= 0.8) and writes JSON.

Usage: OMP_NUM_THREADS=1 python benchmarks/relay_selector_cost.py --limit 5 \
           --json benchmarks/results/relay-selector-cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from kvrelay.cache.kv import SequenceKV
from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine
from kvrelay.engine.call import run_plan
from kvrelay.eval.harness import environment
from kvrelay.model.schedule import LayerView
from kvrelay.pipeline.runner import PipelineRunner
from kvrelay.pipeline.workloads import get_workload
from kvrelay.reuse import get_method
from kvrelay.reuse.band import BandSchedule
from kvrelay.reuse.relay import RelayMethod
from kvrelay.weights.loader import DEFAULT_MODEL, load_model


class WholeDetectionLayer(BandSchedule):
    """Detection with the whole L_det computed for every relayed token, selection applied after it."""

    def selects_before_attention(self, layer: int) -> bool:
        return False

    def after_layer(self, view: LayerView) -> torch.Tensor | None:
        if view.layer == self.select_layer != self.end_layer:
            return self.before_attention(view)
        return super().after_layer(view)


class FixedSelection(BandSchedule):
    """The band with a selection known in advance: no selector work, no cached V gathered."""

    def needs_prev_kv(self, layer: int) -> bool:
        return False


def _variants(plan, kept_idx: torch.Tensor) -> dict[str, BandSchedule]:
    s = plan.schedule

    def fixed(view: LayerView, span_rows: torch.Tensor, new_rows: torch.Tensor) -> torch.Tensor:
        return torch.isin(view.active_idx[span_rows], kept_idx)

    return {"relay (whole L_det)": WholeDetectionLayer(s.new_idx, s.span_entries, s.select_layer, s.end_layer,
                                                       s.selector),
            "static": FixedSelection(s.new_idx, s.span_entries, s.select_layer, s.end_layer, fixed)}


def time_call(lm, method: RelayMethod, call, store: KVStore, variant: str, kept: torch.Tensor | None
              ) -> tuple[float, int, torch.Tensor | None]:
    """TTFT ms (plan + loads + prefill), computed token-layers, and (for relay) the kept prompt indices."""
    n = len(call.prompt_ids)
    ids = torch.tensor(call.prompt_ids)
    recorded: list[torch.Tensor] = []
    t0 = time.perf_counter()
    if variant == "full":
        plan = Engine(lm).method("full").plan(call, store, lm)
    else:
        plan = method.plan(call, store, lm)
        if variant == "relay":
            inner = plan.schedule.selector

            def recording(view, span_rows, new_rows):
                keep = inner(view, span_rows, new_rows)
                recorded.append(view.active_idx[span_rows][keep])
                return keep

            plan.schedule.selector = recording
        else:
            plan.schedule = _variants(plan, kept)[variant]
    cache = SequenceKV(lm.config, lm.model.dtype, lm.model.device, capacity=n + 1)
    result, _ = run_plan(lm, ids, plan, cache, store)
    ms = (time.perf_counter() - t0) * 1e3
    return ms, result.num_computed_token_layers, (recorded[0] if recorded else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="gsm8k-chain3")
    parser.add_argument("--limit", type=int, default=5, help="problems")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per variant and call (median)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--method", default="relay", help="the relay spec, e.g. relay[top_r=0.15,l_pre=4]")
    parser.add_argument("--offset", type=int, default=0, help="index of the first problem")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    lm = load_model(args.model)
    method = get_method(args.method)
    if not isinstance(method, RelayMethod):
        parser.error(f"--method must be a relay spec, got {args.method!r}")
    wl = get_workload(args.workload)
    variants = ("full", "relay", "relay (whole L_det)", "static")
    rows = []
    for problem in wl.problems(None, args.offset + args.limit)[args.offset:]:
        engine = Engine(lm, KVStore(4 << 30), methods=("full", method))

        def probe(agent, call, position, engine=engine, problem=problem):
            if not any(r.kind == "output" for r in call.refs):
                return
            times = {v: [] for v in variants}
            counts, kept = {}, None
            for _ in range(args.repeats):  # interleaved: machine noise hits every variant alike
                for v in variants:
                    ms, computed, rec = time_call(lm, method, call, engine.store, v, kept)
                    times[v].append(ms)
                    counts[v] = computed
                    kept = rec if rec is not None else kept
            row = {"problem_id": problem.problem_id, "agent": agent.name, "num_prompt_tokens": len(call.prompt_ids),
                   "ttft_ms": {v: statistics.median(t) for v, t in times.items()}, "token_layers": counts}
            rows.append(row)
            print(f"{problem.problem_id} {agent.name}: " + ", ".join(f"{v} {row['ttft_ms'][v]:.0f} ms"
                                                                      for v in variants), file=sys.stderr)

        PipelineRunner(engine, wl.spec, run_id=problem.problem_id).run(problem.inputs, "full", before_call=probe)
    speedup = {v: statistics.median(r["ttft_ms"]["full"] / r["ttft_ms"][v] for r in rows) for v in variants}
    ratio = statistics.median(r["ttft_ms"]["static"] / r["ttft_ms"]["relay"] for r in rows)
    whole = statistics.median(r["ttft_ms"]["relay (whole L_det)"] / r["ttft_ms"]["relay"] for r in rows)
    layers = method.layers(lm)
    summary = {"env": environment("cpu"), "model": lm.name, "workload": args.workload, "method": args.method,
               "offset": args.offset, "n_calls": len(rows),
               "relay_layers": layers, "speedup_vs_full": speedup, "relay_over_static_speedup": ratio,
               "whole_over_relay_ttft": whole, "calls": rows}
    print(f"{len(rows)} calls, relay layers {layers}: median speedup over full " +
          ", ".join(f"{v} {s:.2f}x" for v, s in speedup.items()))
    print(f"relay's speedup / static's: {ratio:.3f}; TTFT with the whole detection layer / relay: {whole:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
