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

Usage: OMP_NUM_THREADS=1 python research/relay_selector_cost.py --limit 5 \
           --json benchmarks/results/relay-selector-cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

from kvrelay.cache.kv import SequenceKV
from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine
from kvrelay.engine.call import run_plan, sync_device
from kvrelay.eval.harness import environment
from kvrelay.model.schedule import Entry, LayerView
from kvrelay.pipeline.runner import PipelineRunner, agent_role
from kvrelay.pipeline.workloads import get_workload
from kvrelay.reuse import get_method
from kvrelay.reuse.band import BandSchedule, Kept
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


def _replay(kept: dict[int, tuple[torch.Tensor, torch.Tensor]], num_tokens: int, device: torch.device
            ) -> dict[int, tuple[torch.Tensor, int, torch.Tensor]]:
    """What relay kept (layer -> (prompt indices it chose among, keep mask)) as layer -> (bool [num_tokens] by
    prompt position on ``device``, count, the kept prompt indices on the CPU): made before the clock starts, so
    the replay reads no count back."""
    replay = {}
    for layer, (idx, mask) in kept.items():
        chosen = idx.to(device)[mask.to(device)]
        by_pos = torch.zeros(num_tokens, dtype=torch.bool, device=device)
        by_pos[chosen] = True
        replay[layer] = (by_pos, chosen.numel(), chosen.cpu())
    return replay


def _variants(plan, replay: dict[int, tuple[torch.Tensor, int, torch.Tensor]]) -> dict[str, BandSchedule]:
    """The comparison schedules of relay's ``plan``, given what relay kept at each selecting layer (``_replay``)."""
    s = plan.schedule

    def fixed(view: LayerView, span_rows: torch.Tensor, new_rows: torch.Tensor) -> Kept:
        if view.layer not in replay:  # admitted tokens at the admission layer: all stay
            return Kept(torch.ones(span_rows.numel(), dtype=torch.bool, device=span_rows.device), span_rows.numel())
        by_pos, num, _ = replay[view.layer]
        return Kept(by_pos.index_select(0, view.active_idx.index_select(0, span_rows)), num)

    entries = dict(s.span_entries)
    if s._admit is not None:  # only the admitted tokens enter (with their carried states)
        e = entries[s.select_layer]
        admitted = replay[s.select_layer][2]  # prompt indices, on the CPU like the entry's
        rows = torch.isin(e.token_idx, admitted).nonzero().flatten()  # CPU tensors: no GPU wait
        entries[s.select_layer] = Entry(e.token_idx.index_select(0, rows),
                                        e.hidden.index_select(0, rows.to(e.hidden.device)))
        replay = {layer: r for layer, r in replay.items() if layer != s.select_layer}
    variants = {"static": FixedSelection(s.new_idx, entries, s.select_layer, s.end_layer, fixed,
                                         fixed if s.prune is not None else None)}
    if s._admit is None:
        variants["relay (whole L_det)"] = WholeDetectionLayer(s.new_idx, s.span_entries, s.select_layer,
                                                              s.end_layer, s.selector, s.prune)
    return variants


def _recording(schedule: BandSchedule, kept: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Wrap the schedule's selector, admission and pruning to note what they keep at each layer: (the prompt
    indices chosen among, keep mask), as tensors only (reading them out would make a GPU wait in the timing)."""
    def noting(inner):
        def select(view, span_rows, new_rows):
            keep = inner(view, span_rows, new_rows)
            kept[view.layer] = (view.active_idx.index_select(0, span_rows), keep.mask if isinstance(keep, Kept)
                                else keep)
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
            kept[view.layer] = (entering_idx, keep)
            return keep

        schedule._admit = admit


def time_call(lm, method: RelayMethod, call, store: KVStore, variant: str, kept: dict[int, tuple]
              ) -> tuple[float, int]:
    """TTFT ms (plan + loads + prefill) and computed token-layers; a `relay` run fills ``kept`` (``_recording``),
    which the other variants replay."""
    n = len(call.prompt_ids)
    ids = torch.tensor(call.prompt_ids)
    replay = _replay(kept, n, lm.model.device) if variant not in ("full", "relay") else None
    sync_device(lm.model.device)
    t0 = time.perf_counter()
    if variant == "full":
        plan = Engine(lm).method("full").plan(call, store, lm)
    else:
        plan = method.plan(call, store, lm)
        if variant == "relay":
            kept.clear()
            _recording(plan.schedule, kept)
        else:
            plan.schedule = _variants(plan, replay)[variant]
    cache = SequenceKV(lm.config, lm.model.dtype, lm.model.device, capacity=n + 1)
    result, _ = run_plan(lm, ids, plan, cache, store)
    sync_device(lm.model.device)  # a GPU's queued work is part of the call
    ms = (time.perf_counter() - t0) * 1e3
    return ms, result.num_computed_token_layers


def sync_sites(fn) -> dict[str, int]:
    """On CUDA: the source lines where the host waited for the GPU while ``fn`` ran (torch's sync debug mode
    warns at each), counted."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return dict(Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught).most_common())


def measure(lm, spec: str, workload: str, offset: int, limit: int, repeats: int) -> dict:
    """Every downstream call of ``limit`` problems from ``offset``: full, relay (``spec``) and its static replay
    (plus the whole-L_det variant where relay detects above L_start), timed interleaved; the summary."""
    method = get_method(spec)
    if not isinstance(method, RelayMethod):
        raise ValueError(f"the method must be a relay spec, got {spec!r}")
    wl = get_workload(workload)
    layers = method.layers(lm, agent_role(wl.spec.agents[-1]))  # a downstream agent's (its workload's selector)
    admits = layers[0] == layers[1] > 0
    variants = ("full", "relay", "static") if admits else ("full", "relay", "relay (whole L_det)", "static")
    rows = []
    sites = {} if lm.model.device.type == "cuda" else None
    for problem in wl.problems(None, offset + limit)[offset:]:
        engine = Engine(lm, KVStore(4 << 30), methods=("full", method))

        def probe(agent, call, position, engine=engine, problem=problem):
            if not any(r.kind == "output" for r in call.refs):
                return
            times = {v: [] for v in variants}
            counts, kept = {}, {}
            for _ in range(repeats):  # interleaved: machine noise hits every variant alike
                for v in variants:
                    ms, computed = time_call(lm, method, call, engine.store, v, kept)
                    times[v].append(ms)
                    counts[v] = computed
            if sites is not None and not sites:  # the first call: where each variant makes the host wait
                sites.update({v: sync_sites(lambda v=v: time_call(lm, method, call, engine.store, v, kept))
                              for v in variants})
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
    print(f"{len(rows)} calls, relay layers {layers}: median speedup over full " +
          ", ".join(f"{v} {s:.2f}x" for v, s in speedup.items()))
    print(f"relay's speedup / static's: {ratio:.3f}" +
          (f"; TTFT with the whole detection layer / relay: {whole:.3f}" if whole is not None else ""))
    return {"env": environment(str(lm.model.device)), "model": lm.name, "dtype": str(lm.model.dtype),
            "workload": workload, "method": spec, "offset": offset, "n_calls": len(rows),
            "relay_layers": layers, "speedup_vs_full": speedup, "relay_over_static_speedup": ratio,
            "whole_over_relay_ttft": whole, "sync_sites": sites, "calls": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="gsm8k-chain3")
    parser.add_argument("--limit", type=int, default=5, help="problems")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per variant and call (median)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (research/gpu_check.py's part selector)")
    parser.add_argument("--method", default="relay", help="the relay spec, e.g. relay[keep_share=0.15,span_openings=4]")
    parser.add_argument("--offset", type=int, default=0, help="index of the first problem")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    lm = load_model(args.model, device=args.device)
    try:
        summary = measure(lm, args.method, args.workload, args.offset, args.limit, args.repeats)
    except ValueError as exc:
        parser.error(str(exc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
