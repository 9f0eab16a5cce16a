"""What relay's selection costs: relay against the same schedule with its selection fixed in advance.

For every downstream call of a workload (reference pipeline run with `full`), with relay's shipped
profile, times interleaved (median of --repeats):
- `full`;
- `relay`: the band, selecting at L_det from the fresh Q/K/V before that layer's attention and MLP (or,
  with L_det = L_start, admitting span tokens before they join), and pruning above it where the
  selector says so;
- `relay (whole L_det)` (only for a relay detecting above L_start): the same, but the detection layer
  computed whole for every relayed token and the selection applied after it (the method as first
  implemented);
- `static`: relay's own per-layer active sets replayed with no selector (the kept tokens recorded
  from relay's run, at every layer that selects; no deviation, no influence, no gather of the cached
  V; admitted tokens simply enter): what the computed token-layers cost by themselves.
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
from kvrelay.model.schedule import Entry, LayerView
from kvrelay.pipeline.runner import PipelineRunner, agent_role
from kvrelay.pipeline.workloads import get_workload
from kvrelay.reuse import get_method
from kvrelay.reuse.band import BandSchedule
from kvrelay.reuse.relay import RelayMethod
from kvrelay.weights.loader import DEFAULT_MODEL, load_model


class WholeDetectionLayer(BandSchedule):
    """Detection with the whole L_det computed for every relayed token, selection applied after it."""

    def selects_before_attention(self, layer: int) -> bool:
        return self._prunes_at(layer)  # pruning above it stays as relay runs it

    def after_layer(self, view: LayerView) -> torch.Tensor | None:
        if view.layer == self.select_layer != self.end_layer:
            return self.before_attention(view)  # the selector, after the whole layer
        return super().after_layer(view)


class FixedSelection(BandSchedule):
    """The band with a selection known in advance: no selector work, no cached V gathered."""

    def needs_prev_kv(self, layer: int) -> bool:
        return False


def _variants(plan, kept: dict[int, torch.Tensor]) -> dict[str, BandSchedule]:
    """The comparison schedules of relay's ``plan``, given the prompt indices relay kept at each selecting
    layer (``kept``)."""
    s = plan.schedule

    def fixed(view: LayerView, span_rows: torch.Tensor, new_rows: torch.Tensor) -> torch.Tensor:
        if view.layer not in kept:  # admitted tokens at the admission layer: all stay
            return torch.ones(span_rows.numel(), dtype=torch.bool)
        return torch.isin(view.active_idx[span_rows], kept[view.layer])

    entries = dict(s.span_entries)
    if s._admit is not None:  # only the admitted tokens enter (with their carried states)
        e = entries[s.select_layer]
        mask = torch.isin(e.token_idx, kept[s.select_layer])
        entries[s.select_layer] = Entry(e.token_idx[mask], e.hidden[mask])
        kept = {layer: idx for layer, idx in kept.items() if layer != s.select_layer}
    variants = {"static": FixedSelection(s.new_idx, entries, s.select_layer, s.end_layer, fixed,
                                         fixed if s.prune is not None else None)}
    if s._admit is None:
        variants["relay (whole L_det)"] = WholeDetectionLayer(s.new_idx, s.span_entries, s.select_layer,
                                                              s.end_layer, s.selector, s.prune)
    return variants


def _recording(schedule: BandSchedule, kept: dict[int, torch.Tensor]) -> None:
    """Wrap the schedule's selector, admission and pruning to note the prompt indices kept at each layer."""
    def noting(inner):
        def select(view, span_rows, new_rows):
            keep = inner(view, span_rows, new_rows)
            kept[view.layer] = view.active_idx[span_rows][keep]
            return keep
        return select

    if schedule.selector is not None:
        schedule.selector = noting(schedule.selector)
    if schedule.prune is not None:
        schedule.prune = noting(schedule.prune)
    if schedule._admit is not None:
        inner_admit = schedule._admit

        def admit(view, entering_idx):
            keep = inner_admit(view, entering_idx)
            kept[view.layer] = entering_idx[keep]
            return keep

        schedule._admit = admit


def time_call(lm, method: RelayMethod, call, store: KVStore, variant: str, kept: dict[int, torch.Tensor]
              ) -> tuple[float, int]:
    """TTFT ms (plan + loads + prefill) and computed token-layers; a `relay` run fills ``kept`` (layer -> the
    prompt indices kept there), which the other variants replay."""
    n = len(call.prompt_ids)
    ids = torch.tensor(call.prompt_ids)
    t0 = time.perf_counter()
    if variant == "full":
        plan = Engine(lm).method("full").plan(call, store, lm)
    else:
        plan = method.plan(call, store, lm)
        if variant == "relay":
            kept.clear()
            _recording(plan.schedule, kept)
        else:
            plan.schedule = _variants(plan, dict(kept))[variant]
    cache = SequenceKV(lm.config, lm.model.dtype, lm.model.device, capacity=n + 1)
    result, _ = run_plan(lm, ids, plan, cache, store)
    ms = (time.perf_counter() - t0) * 1e3
    return ms, result.num_computed_token_layers


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
    layers = method.layers(lm, agent_role(wl.spec.agents[-1]))  # a downstream agent's (its workload's selector)
    admits = layers[0] == layers[1] > 0
    variants = ("full", "relay", "static") if admits else ("full", "relay", "relay (whole L_det)", "static")
    rows = []
    for problem in wl.problems(None, args.offset + args.limit)[args.offset:]:
        engine = Engine(lm, KVStore(4 << 30), methods=("full", method))

        def probe(agent, call, position, engine=engine, problem=problem):
            if not any(r.kind == "output" for r in call.refs):
                return
            times = {v: [] for v in variants}
            counts, kept = {}, {}
            for _ in range(args.repeats):  # interleaved: machine noise hits every variant alike
                for v in variants:
                    ms, computed = time_call(lm, method, call, engine.store, v, kept)
                    times[v].append(ms)
                    counts[v] = computed
            if counts["static"] != counts["relay"]:
                raise RuntimeError(f"static replay computed {counts['static']} token-layers, relay {counts['relay']}")
            row = {"problem_id": problem.problem_id, "agent": agent.name, "num_prompt_tokens": len(call.prompt_ids),
                   "ttft_ms": {v: statistics.median(t) for v, t in times.items()}, "token_layers": counts}
            rows.append(row)
            print(f"{problem.problem_id} {agent.name}: " + ", ".join(f"{v} {row['ttft_ms'][v]:.0f} ms"
                                                                      for v in variants), file=sys.stderr)

        PipelineRunner(engine, wl.spec, run_id=problem.problem_id).run(problem.inputs, "full", before_call=probe)
    speedup = {v: statistics.median(r["ttft_ms"]["full"] / r["ttft_ms"][v] for r in rows) for v in variants}
    ratio = statistics.median(r["ttft_ms"]["static"] / r["ttft_ms"]["relay"] for r in rows)
    whole = statistics.median(r["ttft_ms"]["relay (whole L_det)"] / r["ttft_ms"]["relay"] for r in rows) \
        if not admits else None
    summary = {"env": environment("cpu"), "model": lm.name, "workload": args.workload, "method": args.method,
               "offset": args.offset, "n_calls": len(rows),
               "relay_layers": layers, "speedup_vs_full": speedup, "relay_over_static_speedup": ratio,
               "whole_over_relay_ttft": whole, "calls": rows}
    print(f"{len(rows)} calls, relay layers {layers}: median speedup over full " +
          ", ".join(f"{v} {s:.2f}x" for v, s in speedup.items()))
    print(f"relay's speedup / static's: {ratio:.3f}" +
          (f"; TTFT with the whole detection layer / relay: {whole:.3f}" if whole is not None else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
