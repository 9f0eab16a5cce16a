"""Is the oracle's ranking the best one? Oracle selections ranked four ways, at the same share, on calibration calls.

``relay_oracle.py``'s oracle recomputes, at every layer, the span tokens whose keys really move most (the L2
distance between the reused and the fresh prefill's keys, mean over layers ORACLE_FROM_LAYER..L-1). A token's
move matters to the first token through what reads it, so this study also ranks by the move weighted by the
attention the call's new tokens pay the token in the fresh prefill (summed over heads, queries and the same
layers): ``attn*(k+v)`` weights the key and value distances, ``attn*v`` the value distance alone, ``attn`` is the
attention alone. Each selection (the new tokens plus the top share of the span tokens) runs as a static schedule
and is scored on the first token against ``full``.

Usage: python benchmarks/relay_oracle_ranks.py --problems 20 --offset 100 --ratios 0.045,0.1 --json OUT.json
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from relay_oracle import ORACLE_FROM_LAYER, fresh_prefill, key_distance, schedule_logits
from relay_train_points import calls_parser

from kvrelay.cache.store import KVStore
from kvrelay.eval.calibration_calls import downstream_calls
from kvrelay.eval.fidelity import first_token_agrees, kl_first_token
from kvrelay.eval.harness import environment
from kvrelay.model.layers import attention_probs, visible_mask
from kvrelay.model.schedule import StaticSchedule
from kvrelay.reuse.base import CallInput, SpanLoad
from kvrelay.reuse.spans import collect_reuse
from kvrelay.weights.loader import load_model


def rankings(lm, call: CallInput, store: KVStore
             ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, list[SpanLoad], torch.Tensor] | None:
    """(name -> score [m] over the approximate span tokens, their prompt positions, the new tokens', the loads,
    full's first-token logits); None without approximate spans. Keys are compared as cached (rotated): both sides
    of a difference sit at the same position, so the rotation keeps its norm."""
    n, num_layers = len(call.prompt_ids), lm.config.num_layers
    reuse = collect_reuse(call, store, lm.fingerprint)
    span_idx = reuse.approx_idx()
    if not span_idx.numel():
        return None
    result, fresh = fresh_prefill(lm, call, tuple(range(num_layers)))
    k_dist, loaded = key_distance(lm, call, store, fresh, reuse)  # [L, m]
    v_dist = (loaded.v[:, :, span_idx] - fresh.v[:, :, span_idx]).float().pow(2).sum(dim=(1, 3)).sqrt()  # [L, m]
    new_idx = reuse.new_idx(n)
    attn = []
    for layer in range(num_layers):
        active, hidden = result.captured[layer]
        h_new = hidden[torch.isin(active, new_idx)]
        q, _, _ = lm.model.model.layers[layer].project(h_new, *lm.model.rope_of(layer).cos_sin(new_idx, h_new.dtype, n))
        probs = attention_probs(q, fresh.k[layer][:, :n], visible_mask(new_idx, n, lm.config.window_at(layer)))
        attn.append(probs.sum(dim=(0, 1)).index_select(0, span_idx))  # of [H, n_new, n]
    attn = torch.stack(attn)[ORACLE_FROM_LAYER:]  # [L - from, m]
    k_dist, v_dist = k_dist[ORACLE_FROM_LAYER:], v_dist[ORACLE_FROM_LAYER:]
    # the key move alone is relay_oracle's ranking; the others weight a move by what the new tokens read of it
    scores = {"key": k_dist.mean(0), "attn*(k+v)": (attn * (k_dist + v_dist)).sum(0), "attn*v": (attn * v_dist).sum(0),
              "attn": attn.sum(0)}
    return scores, span_idx, new_idx, reuse.loads, result.logits


def main() -> None:
    ap = calls_parser(__doc__.splitlines()[0], problems=20, path_tokens=False)
    ap.add_argument("--ratios", default="0.045,0.1", help="shares of the span tokens recomputed, a comma list")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    ratios = tuple(float(r) for r in args.ratios.split(","))
    rows: dict[str, list[dict]] = {}

    def on_call(call, store) -> None:
        found = rankings(lm, call, store)
        if found is None:
            return
        scores, span_idx, new_idx, loads, full_logits = found
        for ratio in ratios:
            top_k = max(1, round(ratio * span_idx.numel()))
            for name, score in scores.items():
                active = torch.cat([new_idx, span_idx[score.topk(top_k).indices]]).unique()
                logits, reuse = schedule_logits(lm, call, store, StaticSchedule(active), loads)
                rows.setdefault(f"{ratio} {name}", []).append({
                    "kl": kl_first_token(full_logits, logits), "reuse": reuse,
                    "agree": first_token_agrees(full_logits, logits)})

    downstream_calls(lm, args.workload, None, args.problems, (), on_call, "calls", True, args.offset)
    summary = {name: {k: sum(float(r[k]) for r in rs) / len(rs) for k in ("kl", "reuse", "agree")}
               for name, rs in rows.items()}
    Path(args.json).write_text(json.dumps({
        "model": lm.name, "workload": args.workload, "offset": args.offset, "problems": args.problems,
        "ratios": ratios, "from_layer": ORACLE_FROM_LAYER, "environment": environment("cpu"), "summary": summary,
        "calls": rows}, indent=1) + "\n")
    for name, s in summary.items():
        print(f"{name:18s} reuse {s['reuse']:.3f}  first token {s['agree']:.3f}  KL {s['kl']:.4f}")


if __name__ == "__main__":
    main()
