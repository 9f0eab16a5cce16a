"""How good could relay's token selection be? Oracle selections beside the real methods, on calls outside test.

For every downstream call of a workload (run with `full`), the fresh prefill's K/V says which reused tokens
really deviate: per token, the L2 distance between the re-rotated reused keys and the fresh keys, averaged
over layers 4..L-1. "oracle top r" recomputes the top r of the span tokens by that measure at every layer
(the rest of the spans read the reused KV as is, as in `epic`); it is the best any selector of r of the
tokens could do with that ranking, and no real method can know it before computing the fresh K/V; "+ pre K"
also recomputes each span's first K tokens (as `epic[k=K]`), r then being the share of the others. Beside
it: `naive`, `epic`, `relay` (shipped profile), relay variants that keep the top r of span tokens at L_det
by a deviation signal (a fixed budget instead of thresholds), and the share of near-tie calls. Only the
first token is scored (KL and top-1 agreement against `full`). Problems [offset, offset+limit) of --data (default:
GSM8K train for GSM8K workloads, else the workload's own file; HumanEval "train" is --offset 100).

Usage: python research/relay_oracle.py --limit 10 --json benchmarks/results/relay-oracle-train.json
       python research/relay_oracle.py --model gemma3-270m --workload humaneval-adr --offset 100 --json OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from kvrelay.cache.kv import SequenceKV
from kvrelay.cache.store import KVStore
from kvrelay.data.datasets import data_root
from kvrelay.engine import Engine, GenerateOptions
from kvrelay.engine.call import run_plan
from kvrelay.errors import KvRelayError
from kvrelay.eval.calibration_calls import calibration_data
from kvrelay.eval.fidelity import first_token_agrees, first_token_margin, kl_first_token
from kvrelay.eval.harness import environment
from kvrelay.eval.report import NEAR_TIE_MARGIN, is_near_tie
from kvrelay.model.sampling import SamplingConfig
from kvrelay.model.schedule import LayerView, StaticSchedule
from kvrelay.pipeline.runner import PipelineRunner
from kvrelay.pipeline.workloads import get_workload
from kvrelay.reuse.base import CallInput, Plan
from kvrelay.reuse.relay import RelayMethod
from kvrelay.reuse.relay_select import value_cos_deviation
from kvrelay.reuse.spans import collect_reuse
from kvrelay.weights.loader import DEFAULT_MODEL, load_model

ORACLE_FROM_LAYER = 4  # the oracle ranks by deviation above the layers any band here recomputes for all


@dataclass
class TopRelay(RelayMethod):
    """relay's band, but at L_det keep a fixed share ``ratio`` of span tokens, ranked by ``signal``
    ("vcos": 1 - value cosine, "kvl2": key + value L2 distance), plus each span's first ``span_openings``."""

    signal: str = "vcos"
    ratio: float = 0.2

    def plan(self, call: CallInput, store: KVStore | None, lm) -> Plan:
        plan = super().plan(call, store, lm)
        reuse = collect_reuse(call, store, lm.fingerprint)
        l_pre = self.span_openings or 0  # None (the profile's): no openings kept beyond the top r
        heads = [torch.arange(ld.dst_start, ld.dst_start + min(l_pre, ld.num_tokens)) for ld in reuse.approx]
        head_idx = torch.cat(heads) if heads else torch.empty(0, dtype=torch.long)

        def selector(view: LayerView, span_rows: torch.Tensor, new_rows: torch.Tensor) -> torch.Tensor:
            if self.signal == "vcos":
                dev = value_cos_deviation(view, span_rows)
            else:
                dv = (view.v[:, span_rows] - view.prev_v[:, span_rows]).float().pow(2).sum(dim=(0, 2))
                dk = (view.k[:, span_rows] - view.prev_k[:, span_rows]).float().pow(2).sum(dim=(0, 2))
                dev = (dv + dk).sqrt()
            keep = torch.isin(view.active_idx[span_rows], head_idx)
            budget = round(self.ratio * span_rows.numel()) - int(keep.sum())
            if budget > 0:
                keep[dev.masked_fill(keep, -1.0).topk(budget).indices] = True
            return keep

        plan.schedule.selector = selector
        return plan


def fresh_prefill(lm, call: CallInput, capture_layers: tuple[int, ...] = ()):
    """A full prefill of the call's prompt into a cache of its own: (the run's result, whose logits are full's first
    token's, with the hidden states of ``capture_layers``; the cache)."""
    n = len(call.prompt_ids)
    cache = SequenceKV(lm.config, lm.model.dtype, lm.model.device, capacity=n + 1)
    result, _ = run_plan(lm, torch.tensor(call.prompt_ids), Plan(StaticSchedule(torch.arange(n))), cache, None,
                         capture_layers=capture_layers)
    return result, cache


def schedule_logits(lm, call: CallInput, store: KVStore, schedule, loads: list) -> tuple[torch.Tensor, float]:
    """First-token logits and reuse (1 - computed token-layers / all) of ``schedule`` over the call's ``loads``."""
    n = len(call.prompt_ids)
    cache = SequenceKV(lm.config, lm.model.dtype, lm.model.device, capacity=n + 1)
    result, _ = run_plan(lm, torch.tensor(call.prompt_ids), Plan(schedule, loads), cache, store)
    return result.logits, 1 - result.num_computed_token_layers / (n * lm.config.num_layers)


def loaded_cache(lm, call: CallInput, store: KVStore, loads: list) -> SequenceKV:
    """A sequence cache holding the call's reused K/V as loaded (re-rotated, not repaired)."""
    cache = SequenceKV(lm.config, lm.model.dtype, lm.model.device, capacity=len(call.prompt_ids) + 1)
    for ld in loads:
        cache.load_span(store.get(ld.span_id), ld.dst_start, lm.model.rope, ld.src_start, ld.src_end)
    return cache


def key_distance(lm, call: CallInput, store: KVStore, fresh: SequenceKV, reuse=None
                 ) -> tuple[torch.Tensor, SequenceKV]:
    """Per layer, the L2 distance between each approximate span token's reused key and its key in ``fresh``
    (a full prefill of the prompt): [num_layers, num span tokens], in ``reuse.approx_idx()`` order; and the
    loaded cache it read. The oracle ranks by its mean over layers ORACLE_FROM_LAYER..L-1."""
    reuse = reuse or collect_reuse(call, store, lm.fingerprint)
    cache = loaded_cache(lm, call, store, reuse.loads)
    span_idx = reuse.approx_idx()
    return (cache.k[:, :, span_idx] - fresh.k[:, :, span_idx]).float().pow(2).sum(dim=(1, 3)).sqrt(), cache  # [L, m]


def oracle_active(lm, call: CallInput, store: KVStore, fresh: SequenceKV, ratio: float,
                  pre: int = 0) -> tuple[torch.Tensor, list]:
    """The prompt positions the oracle computes at every layer (the new tokens, each span's first ``pre``
    tokens and the top ``ratio`` of the other span tokens by their true key deviation, reused vs ``fresh``,
    layers ORACLE_FROM_LAYER..L-1) and the span loads for the rest."""
    n = len(call.prompt_ids)
    reuse = collect_reuse(call, store, lm.fingerprint)
    span_idx = reuse.approx_idx()
    distance = key_distance(lm, call, store, fresh, reuse)[0][ORACLE_FROM_LAYER:].mean(0)  # [m]
    heads = torch.cat([torch.arange(ld.dst_start, ld.dst_start + min(pre, ld.num_tokens)) for ld in reuse.approx])
    opening = torch.isin(span_idx, heads)
    budget = min(max(1, round(ratio * int((~opening).sum()))), int((~opening).sum()))
    top = span_idx[distance.masked_fill(opening, -1.0).topk(budget).indices]
    return torch.cat([reuse.new_idx(n), heads, top]).unique(), reuse.loads


def oracle_logits(lm, call: CallInput, store: KVStore, fresh: SequenceKV, ratio: float,
                  pre: int = 0) -> tuple[torch.Tensor, float]:
    """First-token logits and reuse of the oracle's selection (``oracle_active``)."""
    active, loads = oracle_active(lm, call, store, fresh, ratio, pre)
    return schedule_logits(lm, call, store, StaticSchedule(active), loads)


def train_calls_parser(description: str) -> argparse.ArgumentParser:
    """The flags of a study over a workload's downstream calls on GSM8K *train* (this one and its kin)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--workload", default="gsm8k-chain3")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--data", default=str(data_root() / "gsm8k" / "train.jsonl"))
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--json", required=True)
    return ap


def main() -> int:
    ap = train_calls_parser(__doc__.splitlines()[0])
    ap.set_defaults(data=None)  # calibration_data: GSM8K train for GSM8K workloads, else the workload's file
    ap.add_argument("--offset", type=int, default=0, help="skip this many problems (HumanEval train: 100)")
    ap.add_argument("--ratios", default="0.05,0.1,0.2", help="the oracle's shares, a comma list")
    ap.add_argument("--oracle-pre", default="0", help="span openings the oracle also recomputes, a comma list")
    args = ap.parse_args()
    env = environment("cpu")
    try:
        lm, wl = load_model(args.model), get_workload(args.workload)
        args.data = calibration_data(args.data, args.workload)
        problems = wl.problems(args.data, args.offset + args.limit)[args.offset:]
    except KvRelayError as exc:
        print(f"relay_oracle: {exc}", file=sys.stderr)
        return 2
    # selector=threshold runs each TopRelay on the band search's layers, which detect above L_start (its selector
    # reads a deviation there); the profile's policy admits where the carried states enter, and never calls it
    methods = {"naive": "naive", "epic[k=8]": "epic[k=8]", "epic": "epic", "relay": "relay",
               "relay top 0.1 (vcos)": TopRelay(signal="vcos", ratio=0.1, selector="threshold"),
               "relay top 0.2 (vcos)": TopRelay(signal="vcos", ratio=0.2, selector="threshold"),
               "relay top 0.2 (vcos) + l_pre 4": TopRelay(signal="vcos", ratio=0.2, span_openings=4,
                                                                   selector="threshold"),
               "relay top 0.2 (kvl2)": TopRelay(signal="kvl2", ratio=0.2, selector="threshold")}
    ratios = tuple(float(r) for r in args.ratios.split(","))
    oracles = {f"oracle top {r}" + (f" + pre {k}" if k else ""): (r, k)
               for k in (int(k) for k in args.oracle_pre.split(",")) for r in ratios}
    names = [*methods, *oracles]
    rows: dict[str, list[dict]] = {m: [] for m in names}
    margins: list[float] = []
    one = SamplingConfig(max_new_tokens=1)
    capture = tuple(sorted({layer for m in methods.values() if not isinstance(m, str)
                            for layer in m.capture_layers(lm)} | set(RelayMethod().capture_layers(lm))))
    for problem in tqdm(problems, desc="calls", unit="problem", file=sys.stderr):
        store = KVStore(4 << 30)
        engine = Engine(lm, store, capture_layers=capture)
        runner = PipelineRunner(engine, wl.spec, run_id=problem.problem_id)

        def probe(agent, call, position, store=store, engine=engine):
            if not any(r.kind == "output" for r in call.refs):
                return
            full = engine.generate(call, "full", GenerateOptions(one, keep_cache=True, feed_last=False))
            margins.append(first_token_margin(full.first_logits))
            outs = {m: engine.generate(call, meth, GenerateOptions(one)) for m, meth in methods.items()}
            scored = {m: (o.first_logits, o.stats.reuse_rate) for m, o in outs.items()}
            for name, (r, k) in oracles.items():
                scored[name] = oracle_logits(lm, call, store, full.cache, r, k)
            for m, (logits, reuse) in scored.items():
                rows[m].append({"kl": kl_first_token(full.first_logits, logits), "reuse": reuse,
                                "agree": first_token_agrees(full.first_logits, logits)})

        runner.run(problem.inputs, "full", before_call=probe)
    summary = {m: {k: sum(float(r[k]) for r in rs) / len(rs) for k in ("reuse", "agree", "kl")}
               for m, rs in rows.items()}
    near_tie_rate = sum(is_near_tie(m) for m in margins) / len(margins)
    Path(args.json).write_text(json.dumps({"env": env, "workload": args.workload, "data": args.data,
                                           "offset": args.offset, "n": args.limit,
                                           "model": lm.name, "n_calls": len(margins), "near_tie_rate": near_tie_rate,
                                           "results": summary, "margins": margins, "calls": rows}, indent=1) + "\n")
    print(f"{len(margins)} calls, {near_tie_rate:.0%} near-ties (full's first token leads by < {NEAR_TIE_MARGIN})")
    for m, s in summary.items():
        print(f"{m:32s} reuse {s['reuse']:.3f}  1st-token agree {s['agree']:.2f}  KL {s['kl']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
