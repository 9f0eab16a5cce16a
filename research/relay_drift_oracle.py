"""How much of the reused spans' K/V deviation is shared by a span's tokens? An oracle on GSM8K *train*.

For every downstream call (reference pipeline run with `full`), the reused spans are loaded as `naive`
loads them, and the fresh prefill's K/V say how each span token's K/V really moved in the new context
(fresh - reused; keys with RoPE undone, so moves at different positions compare). Variants, each then
computing only the call's new tokens over the edited cache (first token scored against `full`):
- `naive`: nothing edited;
- `mean kv` / `mean k` / `mean v`: every span token moved by its span's mean move (per layer, KV head and
  channel), the mean taken over all the span's tokens (an oracle: no method knows them all);
- `openings`: each span's first 4 tokens set to their fresh K/V at every layer (what EPIC recomputes);
- `openings + mean kv`: both, the mean over the other tokens;
- `openings + mean kv from r`: the mean estimated from a random share r of the span's tokens.
relay's `drift` knob is the practical form: the estimate comes from the tokens relay recomputes.

Usage: python research/relay_drift_oracle.py --limit 10 --json benchmarks/results/relay-drift-oracle-train.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from relay_oracle import train_calls_parser
from tqdm import tqdm

import kvrelay.cache.kv as kv_module
from kvrelay.cache.kv import SequenceKV
from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine, GenerateOptions
from kvrelay.eval.fidelity import first_token_agrees, kl_first_token
from kvrelay.eval.harness import environment
from kvrelay.model.sampling import SamplingConfig
from kvrelay.model.schedule import StaticSchedule
from kvrelay.pipeline.runner import PipelineRunner
from kvrelay.pipeline.workloads import get_workload
from kvrelay.reuse.spans import collect_reuse
from kvrelay.weights.loader import load_model

NUM_OPENING = 4
VARIANTS = {"naive": {}, "mean kv": {"mean": "kv"}, "mean k": {"mean": "k"}, "mean v": {"mean": "v"},
            "openings": {"pre": True}, "openings + mean kv": {"pre": True, "mean": "kv"},
            "openings + mean kv from 0.3": {"pre": True, "mean": "kv", "share": 0.3},
            "openings + mean kv from 0.1": {"pre": True, "mean": "kv", "share": 0.1}}


def _shift(lm, layer: int, keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    rope = lm.model.rope_of(layer)
    per_layer = rope.layer_inv_freq is not None
    return rope.shift_keys(keys, delta, layer=layer) if per_layer else rope.shift_keys(keys, delta)


def edited_logits(lm, call, store: KVStore, fresh: SequenceKV, variant: dict) -> torch.Tensor:
    """First-token logits of computing only the new tokens over the reused K/V edited as ``variant`` says."""
    n = len(call.prompt_ids)
    reuse = collect_reuse(call, store, lm.fingerprint)
    cache = SequenceKV(lm.config, lm.model.dtype, lm.model.device, capacity=n + 1)
    for ld in reuse.loads:
        cache.load_span(store.get(ld.span_id), ld.dst_start, lm.model.rope, ld.src_start, ld.src_end)
    k_all, v_all = cache.k, cache.v  # [L, Hkv, T, hd], every row copied in
    for ld in reuse.approx:
        idx = torch.arange(ld.dst_start, ld.dst_start + ld.num_tokens)
        if variant.get("pre"):
            head, idx = idx[:NUM_OPENING], idx[NUM_OPENING:]
            k_all[:, :, head], v_all[:, :, head] = fresh.k[:, :, head], fresh.v[:, :, head]
        if not variant.get("mean") or not idx.numel():
            continue
        sample = torch.arange(idx.numel())
        if "share" in variant:
            gen = torch.Generator().manual_seed(ld.dst_start)
            sample = torch.randperm(idx.numel(), generator=gen)[: max(1, round(variant["share"] * idx.numel()))]
        for layer in range(lm.config.num_layers):
            dk = _shift(lm, layer, fresh.k[layer][:, idx] - k_all[layer][:, idx], -idx)  # [Hkv, m, hd], unrotated
            dv = fresh.v[layer][:, idx] - v_all[layer][:, idx]
            mean_k, mean_v = dk[:, sample].mean(1, keepdim=True), dv[:, sample].mean(1, keepdim=True)
            if "k" in variant["mean"]:
                k_all[layer][:, idx] += _shift(lm, layer, mean_k.expand_as(dk).contiguous(), idx)
            if "v" in variant["mean"]:
                v_all[layer][:, idx] += mean_v
    return lm.model.prefill(torch.tensor(call.prompt_ids), cache, StaticSchedule(reuse.new_idx(n))).logits


def main() -> int:
    args = train_calls_parser(__doc__.splitlines()[0]).parse_args()
    kv_module.IN_PLACE_MIN_TOKENS = 1 << 30  # every load copied: the oracle edits the cache's own rows
    lm, wl = load_model(args.model), get_workload(args.workload)
    rows: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    one = SamplingConfig(max_new_tokens=1)
    for problem in tqdm(wl.problems(args.data, args.limit), desc="calls", unit="problem", file=sys.stderr):
        store = KVStore(4 << 30)
        engine = Engine(lm, store)

        def probe(agent, call, position, store=store, engine=engine):
            if not any(r.kind == "output" for r in call.refs):
                return
            full = engine.generate(call, "full", GenerateOptions(one, keep_cache=True, feed_last=False))
            for name, variant in VARIANTS.items():
                logits = edited_logits(lm, call, store, full.cache, variant)
                rows[name].append({"kl": kl_first_token(full.first_logits, logits),
                                   "agree": first_token_agrees(full.first_logits, logits)})

        PipelineRunner(engine, wl.spec, run_id=problem.problem_id).run(problem.inputs, "full", before_call=probe)
    summary = {v: {k: sum(float(r[k]) for r in rs) / len(rs) for k in ("kl", "agree")} for v, rs in rows.items()}
    Path(args.json).write_text(json.dumps({"env": environment("cpu"), "model": lm.name, "workload": args.workload,
                                           "data": args.data, "n": args.limit, "results": summary}, indent=1) + "\n")
    for name, s in summary.items():
        print(f"{name:30s} KL {s['kl']:.4f}  1st-token agree {s['agree']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
