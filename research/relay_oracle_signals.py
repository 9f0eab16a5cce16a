"""Which cheap signal finds the span tokens the oracle recomputes? Per downstream call on calibration (train) calls.

The oracle (``relay_oracle.py``) ranks a call's span tokens by their true key deviation: the L2 distance between
the reused (re-rotated) and the fresh prefill's keys, averaged over layers ORACLE_FROM_LAYER..L-1. Held to
full's continuation it lowers the KL there well below relay's at equal reuse (``relay_path_oracle.py``). Here
each candidate signal ranks the same tokens, and the share of the oracle's top ``--share`` it recovers (at the
same count) is reported, beside the Spearman correlation, as means over the calls:

- ``opening``: a span's first tokens first (EPIC's prior);
- ``influence@L``: the attention the call's new tokens pay each span token at layer L (relay's admission);
- ``vdev@L``: 1 - cos(fresh V, reused V) at layer L (what a detection layer at L reads);
- ``kdev@L``: the key L2 distance at layer L alone;
- ``away_src@L``: the attention a span token paid, in the call its K/V was stored from, to that call's tokens
  outside its own span and the first position (the context that changed; Cache-Craft's cue), from a fresh
  prefill of the stored tokens (what a store could record when the span is written);
- ``away_dst@L``: the same mass in this call's fresh prefill (the new context it reads instead).

The fresh values stand in for what relay would compute from the carried states (at L_start they coincide).

Usage: python research/relay_oracle_signals.py --model smollm2-135m --workload gsm8k-chain3 --offset 100
    --problems 20 --json OUT.json
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from relay_oracle import ORACLE_FROM_LAYER, fresh_prefill, key_distance
from relay_train_points import calls_parser

from kvrelay.cache.kv import SequenceKV
from kvrelay.engine.call import run_plan
from kvrelay.eval.calibration_calls import downstream_calls
from kvrelay.eval.harness import environment
from kvrelay.model.layers import attention_probs, visible_mask
from kvrelay.model.schedule import StaticSchedule
from kvrelay.reuse.base import CallInput, Plan
from kvrelay.reuse.relay_select import away_mass
from kvrelay.reuse.spans import collect_reuse
from kvrelay.weights.loader import load_model


def _ranks(x: torch.Tensor) -> torch.Tensor:
    return x.argsort().argsort().float()


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()).clamp_min(1e-12))


def recall_at(signal: torch.Tensor, oracle: torch.Tensor, k: int) -> float:
    """Share of the oracle's top ``k`` among the signal's top ``k``."""
    top_o = set(oracle.topk(k).indices.tolist())
    return len(top_o & set(signal.topk(k).indices.tolist())) / k


def fresh_away_mass(lm, ids: list[int], first: int, last: int, layers: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """layer -> [last - first]: per token of ``ids[first:last]``, the attention (summed over heads) it pays, in a
    fresh prefill of ``ids[:last]``, to positions outside [first, itself] other than position 0 (``away_mass`` with
    every position before ``first`` lost)."""
    cache = SequenceKV(lm.config, lm.model.dtype, lm.model.device, capacity=last + 1)
    result, _ = run_plan(lm, torch.tensor(ids[:last]), Plan(StaticSchedule(torch.arange(last))), cache, None,
                         capture_layers=tuple(sorted(set(layers))))
    return {layer: away_mass(lm.model.model.layers[layer], lm.model.rope_of(layer), result.captured[layer][1][first:],
                             cache.k[layer][:, :last], first, lm.config.window_at(layer)) for layer in layers}


def call_signals(lm, call: CallInput, store, layers: tuple[int, ...]) -> dict[str, torch.Tensor] | None:
    """signal name -> [num span tokens] for one call (``oracle`` among them); None without approximate spans."""
    n = len(call.prompt_ids)
    reuse = collect_reuse(call, store, lm.fingerprint)
    span_idx = reuse.approx_idx()
    if not span_idx.numel():
        return None
    result, fresh = fresh_prefill(lm, call, tuple(sorted(set(layers))))
    k_diff, loaded = key_distance(lm, call, store, fresh, reuse)  # [L, m]
    out = {"oracle": k_diff[ORACLE_FROM_LAYER:].mean(0)}
    position = torch.cat([torch.arange(ld.num_tokens) for ld in reuse.approx]).float()
    out["opening"] = -position
    new_idx = reuse.new_idx(n)
    for layer in layers:
        fresh_v = fresh.v[layer][:, span_idx].transpose(0, 1).flatten(1).float()  # [m, Hkv * hd]
        reused_v = loaded.v[layer][:, span_idx].transpose(0, 1).flatten(1).float()
        out[f"vdev@{layer}"] = 1 - torch.nn.functional.cosine_similarity(fresh_v, reused_v, dim=-1)
        out[f"kdev@{layer}"] = k_diff[layer]
        active, hidden = result.captured[layer]
        h_new = hidden[torch.isin(active, new_idx)]
        rope = lm.model.rope_of(layer)
        q, _, _ = lm.model.model.layers[layer].project(h_new, *rope.cos_sin(new_idx, h_new.dtype, n))
        probs = attention_probs(q, fresh.k[layer][:, :n], visible_mask(new_idx, n, lm.config.window_at(layer)))
        out[f"influence@{layer}"] = probs.sum(dim=(0, 1)).index_select(0, span_idx)  # of [H, n_new, n]
    src = [fresh_away_mass(lm, list(store.get(ld.span_id).token_ids), ld.src_start, ld.src_end, layers)
           for ld in reuse.approx]
    dst = [fresh_away_mass(lm, call.prompt_ids, ld.dst_start, ld.dst_start + ld.num_tokens, layers)
           for ld in reuse.approx]
    for layer in layers:
        out[f"away_src@{layer}"] = torch.cat([m[layer] for m in src])
        out[f"away_dst@{layer}"] = torch.cat([m[layer] for m in dst])
    out["away_src@mean"] = torch.stack([out[f"away_src@{layer}"] for layer in layers]).mean(0)
    for layer in layers:  # the opening's ranks and the source mass's, summed (ties broken by the opening)
        out[f"opening+away_src@{layer}"] = _ranks(out["opening"]) + _ranks(out[f"away_src@{layer}"]) - position * 1e-3
    return out


def main() -> None:
    ap = calls_parser(__doc__.splitlines()[0], problems=20, path_tokens=False)
    ap.add_argument("--layers", default="2,3,4,6,8", help="layers the per-layer signals read, a comma list")
    ap.add_argument("--share", type=float, default=0.2, help="the oracle's top share the recall is taken at")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    layers = tuple(int(x) for x in args.layers.split(","))
    rows: list[dict[str, tuple[float, float]]] = []

    def on_call(call: CallInput, store) -> None:
        signals = call_signals(lm, call, store, layers)
        if signals is None:
            return
        oracle = signals.pop("oracle")
        k = max(1, round(args.share * oracle.numel()))
        rows.append({name: (recall_at(s, oracle, k), spearman(s, oracle)) for name, s in signals.items()})

    downstream_calls(lm, args.workload, None, args.problems, (), on_call, "calls", True, args.offset)
    summary = {name: {"recall": sum(r[name][0] for r in rows) / len(rows),
                      "spearman": sum(r[name][1] for r in rows) / len(rows)} for name in rows[0]}
    Path(args.json).write_text(json.dumps({
        "model": lm.name, "workload": args.workload, "offset": args.offset, "problems": args.problems,
        "share": args.share, "num_calls": len(rows), "environment": environment("cpu"), "summary": summary,
        "calls": rows}, indent=1) + "\n")
    print(f"{len(rows)} calls; recall of the oracle's top {args.share:.0%} at the same count, Spearman")
    for name, s in summary.items():
        print(f"  {name:14s} recall {s['recall']:.3f}  spearman {s['spearman']:+.3f}")


if __name__ == "__main__":
    main()
