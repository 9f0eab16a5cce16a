"""How big a move pool pays, and what searching it through an index costs in the estimate (``MovePool`` itself).

``relay_anchor_study.py`` found that the moves of similar span tokens of other problems explain a large share of a
relayed token's K/V move. This script asks how that share grows with the number of pooled calls, and whether the
index ``relay_anchors`` now searches (the match features projected on their top principal directions, the tokens
grouped into k-means clusters) keeps it. It runs the shipped ``MovePool`` on real calls: for each downstream call of
the pool problems (from ``--pool-offset``, as many as the largest of ``--pool-sizes``; GSM8K *train* by default) and
of the scored problems (``--offset``, ``--problems``; none of them a pool problem), a full prefill gives every
approximate span token's true
move at every layer (fresh - loaded, keys with RoPE undone), as ``relay_anchors.observe`` records it. Per pool size
(the first N pool problems) and index setting, each role's pool (the agent called, the span's index among its
approximate spans) is filled, frozen, and asked for the scored tokens' moves. Reported, pooled over the scored calls,
layers 1 up and KV heads: the share of the squared move explained at scale 1 (``1 - |move - estimate|^2 / |move|^2``)
and at the best single scale, for K and V, with the index's rows per role and the estimate's time per call.

Usage: python research/relay_anchor_index.py --problems 20 --offset 100 --pool-offset 120 --pool-sizes 16,40,80,160 \
    --json OUT.json
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from relay_oracle import fresh_prefill, loaded_cache
from relay_train_points import calls_parser

from kvrelay.eval.calibration_calls import downstream_calls
from kvrelay.eval.harness import environment
from kvrelay.model.rope import undo_rotary
from kvrelay.reuse.move_pool import MovePool
from kvrelay.reuse.spans import collect_reuse
from kvrelay.weights.loader import load_model

# (name, dim, num_centroids, temperature): session 31's raw pool, and the index relay_anchors now searches
INDEXES = (("raw (dim 0, every token, t 0.02)", 0, 0, 0.02), ("index (dim 32, 4,096 clusters, t 0.05)", 32, 4096, 0.05))


@dataclass
class SpanMoves:
    """One approximate span of a call: its role, its stored keys (RoPE undone) at the match layer, its true moves."""

    problem: str
    role: str
    keys_free: torch.Tensor  # [Hkv, n, hd]
    k_move: torch.Tensor  # [L, Hkv, n, hd], keys with RoPE undone, fp16
    v_move: torch.Tensor


def collect(lm, workload: str, offset: int, problems: int, match_layer: int) -> list[SpanMoves]:
    spans: list[SpanMoves] = []

    def on_call(call, store) -> None:
        n = len(call.prompt_ids)
        reuse = collect_reuse(call, store, lm.fingerprint)
        if not reuse.approx:
            return
        _, fresh = fresh_prefill(lm, call)
        loaded = loaded_cache(lm, call, store, reuse.loads)
        for i, ld in enumerate(reuse.approx):
            pos = torch.arange(ld.dst_start, ld.dst_start + ld.num_tokens)
            k_move, v_move, keys_free = [], [], None
            for layer in range(lm.config.num_layers):
                cos, sin = lm.model.rope_of(layer).cos_sin(pos, torch.float32, n)
                k_used = undo_rotary(loaded.k[layer][:, pos].float(), cos, sin)  # [Hkv, n, hd]
                k_move.append((undo_rotary(fresh.k[layer][:, pos].float(), cos, sin) - k_used).half())
                v_move.append((fresh.v[layer][:, pos].float() - loaded.v[layer][:, pos].float()).half())
                if layer == match_layer:
                    keys_free = k_used
            spans.append(SpanMoves(ld.span_id.rsplit("/", 1)[0], f"{call.name}#{i}", keys_free,
                                   torch.stack(k_move), torch.stack(v_move)))

    downstream_calls(lm, workload, None, problems, (), on_call, "calls", True, offset)
    return spans


def score(pool_spans: list[SpanMoves], scored: list[SpanMoves], num_layers: int, match_layer: int, dim: int,
          num_centroids: int, temperature: float) -> dict:
    pool = MovePool(match_layer, 1 << 30, 8, temperature, dim=dim, num_centroids=num_centroids)
    for s in pool_spans:
        pool.add(s.role, s.keys_free, s.k_move.float(), s.v_move.float())
    t0 = time.perf_counter()
    for role in sorted({s.role for s in pool_spans}):
        pool.freeze(role)
    freeze_s = time.perf_counter() - t0
    sums = {"k": [0.0, 0.0, 0.0], "v": [0.0, 0.0, 0.0]}  # <D,P>, |P|^2, |D|^2
    estimate_ms = []
    for s in scored:
        t0 = time.perf_counter()
        est = pool.estimate(s.role, s.keys_free, num_layers)
        estimate_ms.append((time.perf_counter() - t0) * 1e3)
        if est is None:
            raise SystemExit(f"role {s.role} has no pool: raise the --pool-sizes")
        for kv, move, e in (("k", s.k_move, est[0]), ("v", s.v_move, est[1])):
            d, p = move[1:].float(), e[1:]  # layer 0 does not move
            acc = sums[kv]
            acc[0] += float((d * p).sum())
            acc[1] += float((p * p).sum())
            acc[2] += float((d * d).sum())
    out = {"freeze_s": freeze_s, "estimate_ms_median": statistics.median(estimate_ms),
           "index_rows": {r: pool.num_entries(r) for r in sorted({s.role for s in pool_spans})},
           "nbytes": pool.nbytes}
    for kv, (dp, pp, dd) in sums.items():
        out[kv] = {"explained_at_1": (2 * dp - pp) / dd, "explained_at_best": dp * dp / (pp * dd),
                   "best_scale": dp / pp}
    return out


def main() -> None:
    ap = calls_parser(__doc__.splitlines()[0], problems=20, path_tokens=False)
    ap.add_argument("--pool-offset", type=int, default=120)
    ap.add_argument("--pool-sizes", default="16,40,80,160", help="pool problems to score with (the first N)")
    args = ap.parse_args()
    sizes = [int(x) for x in args.pool_sizes.split(",")]
    args.pool_problems = max(sizes)
    if args.pool_offset < args.offset + args.problems and args.offset < args.pool_offset + args.pool_problems:
        raise SystemExit("the pool problems and the scored problems overlap: move --pool-offset")
    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    match_layer = lm.config.num_layers // 2  # relay_anchors' default
    scored = collect(lm, args.workload, args.offset, args.problems, match_layer)
    pool_spans = collect(lm, args.workload, args.pool_offset, args.pool_problems, match_layer)
    problems = list(dict.fromkeys(s.problem for s in pool_spans))
    results = {}
    for size in sizes:
        kept = set(problems[:size])
        for name, dim, num_centroids, temperature in INDEXES:
            key = f"{size} problems, {name}"
            results[key] = score([s for s in pool_spans if s.problem in kept], scored, lm.config.num_layers,
                                 match_layer, dim, num_centroids, temperature)
            r = results[key]
            print(f"{key:55s} K {r['k']['explained_at_1']:.3f} (best {r['k']['explained_at_best']:.3f}) "
                  f"V {r['v']['explained_at_1']:.3f} (best {r['v']['explained_at_best']:.3f})  "
                  f"rows {max(r['index_rows'].values())}  {r['estimate_ms_median']:.1f} ms/span  "
                  f"freeze {r['freeze_s']:.1f} s", flush=True)
    Path(args.json).write_text(json.dumps({
        "model": lm.name, "workload": args.workload, "offset": args.offset, "problems": args.problems,
        "pool_offset": args.pool_offset, "pool_problems": args.pool_problems, "match_layer": match_layer,
        "num_scored_spans": len(scored), "environment": environment("cpu"), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
