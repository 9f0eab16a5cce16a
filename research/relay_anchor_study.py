"""Do a span token's K/V moves repeat across problems? Cross-call anchors for the tokens relay does not recompute.

``relay_drift_study.py`` found that the span tokens a call recomputes say little about how the others move (at most
7% of the key move at a 5% share). KVCOMM's observation is the other way round: the offset a shared text takes on
under a new prefix is similar for similar tokens in the same place of the same pipeline, across requests. This
study measures that on relay's calls. For each downstream call (GSM8K train by default) the true move of every
approximate span token at every layer from 2 up (fresh - loaded, keys with RoPE undone) is read from a full prefill,
as in the drift study. A token's *role* is (the agent called, the index of its span among the call's approximate
spans); in gsm8k-chain3 that is e.g. "the question as the critic reads it". Every estimate below comes from the
*other* problems' calls only (leave one problem out), so no recompute of the call itself is needed:

- ``x_role``: the mean move of the role's tokens (per layer and KV head);
- ``x_place``: the mean move at the same place in the span (the role's mean past the other calls' lengths);
- ``x_token``: the mean move of the same token id in the same role (else ``x_role``);
- ``x_knn@t``: a softmax (temperature t) over the cosine similarity of the token's loaded key (RoPE undone) to the
  same role's tokens' loaded keys, weighting their moves (KVCOMM's anchor matching, per token);
- ``x_top8@Lm``: the cheap form ``relay_anchors`` uses: the 8 pool tokens of the role nearest by the cosine of all
  KV heads' loaded keys at layer m (one match per token), softmax(cos / 0.02) over them, the same weights at every
  layer and head;
- ``span_mean``: the within-call baseline of the drift study (the mean move of the top ``--ratio`` of the span's
  tokens by value deviation, which relay's pruning would recompute);
- ``span_mean+x_token`` / ``span_mean+x_knn``: ``span_mean`` plus the residual ``x_token - x_role`` /
  ``x_knn@0.02 - x_role``.

Roles here use the agent's name (``relay_anchors`` keys them by system prompt and placeholder name: the same
partition on the bench workloads).

The targets are the span tokens outside that top share, as in the drift study. Reported per (K or V, estimator),
pooled over calls, layers and heads: the share of the targets' squared move explained at the best single scale and
at scale 1.

Usage: python research/relay_anchor_study.py --problems 20 --offset 100 --json OUT.json
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from relay_drift_study import FROM_LAYER, by_group
from relay_oracle import fresh_prefill, loaded_cache
from relay_train_points import calls_parser

from kvrelay.eval.calibration_calls import downstream_calls
from kvrelay.eval.harness import environment
from kvrelay.model.rope import undo_rotary
from kvrelay.reuse.spans import collect_reuse
from kvrelay.weights.loader import load_model

TEMPERATURES = (0.01, 0.02, 0.05)
TOP_K = 8  # the cheap form's neighbours
MATCH_LAYERS = (2, 8, 15)  # the cheap form matches once, at one of these layers, on every KV head's key at once


@dataclass
class CallMoves:
    """One call's approximate span tokens: their roles, ids, places and per-layer moves [Hkv, m, hd] (fp16)."""

    problem: str
    role_of: list[str]  # per token
    token_ids: torch.Tensor  # [m]
    place: torch.Tensor  # [m] the token's index in its span
    target_mask: torch.Tensor  # [L', m] per layer from FROM_LAYER: outside the top share by value deviation
    span_of: torch.Tensor  # [m]
    k_move: list[torch.Tensor]  # per layer from FROM_LAYER: fresh - loaded, RoPE undone [Hkv, m, hd]
    v_move: list[torch.Tensor]
    k_used: list[torch.Tensor]  # per layer from FROM_LAYER: the loaded keys, RoPE undone [Hkv, m, hd] (the match)


def collect(lm, args) -> list[CallMoves]:
    calls: list[CallMoves] = []

    def on_call(call, store) -> None:
        n = len(call.prompt_ids)
        reuse = collect_reuse(call, store, lm.fingerprint)
        span_idx = reuse.approx_idx()
        if not span_idx.numel():
            return
        run_id = reuse.approx[0].span_id.rsplit("/", 1)[0]  # the problem's id: spans are "<run id>/<agent>"
        ids = torch.tensor(call.prompt_ids)[span_idx]
        span_of = torch.cat([torch.full((ld.num_tokens,), i) for i, ld in enumerate(reuse.approx)])
        place = torch.cat([torch.arange(ld.num_tokens) for ld in reuse.approx])
        role_of = [f"{call.name}#{int(i)}" for i in span_of]
        _, fresh = fresh_prefill(lm, call)
        loaded = loaded_cache(lm, call, store, reuse.loads)
        m = span_idx.numel()
        k_move, v_move, k_used_all, targets = [], [], [], []
        for layer in range(FROM_LAYER, lm.config.num_layers):
            cos, sin = lm.model.rope_of(layer).cos_sin(span_idx, torch.float32, n)
            k_fresh = undo_rotary(fresh.k[layer][:, span_idx].float(), cos, sin)  # [Hkv, m, hd]
            k_used = undo_rotary(loaded.k[layer][:, span_idx].float(), cos, sin)
            v_fresh, v_used = fresh.v[layer][:, span_idx].float(), loaded.v[layer][:, span_idx].float()
            v_dev = 1 - torch.nn.functional.cosine_similarity(v_fresh.transpose(0, 1).flatten(1),
                                                              v_used.transpose(0, 1).flatten(1), dim=-1)  # [m]
            target = torch.ones(m, dtype=torch.bool)
            target[v_dev.topk(max(1, round(args.ratio * m))).indices] = False
            targets.append(target)
            k_move.append((k_fresh - k_used).half())
            v_move.append((v_fresh - v_used).half())
            k_used_all.append(k_used.half())
        calls.append(CallMoves(run_id, role_of, ids, place, torch.stack(targets), span_of, k_move, v_move,
                               k_used_all))

    downstream_calls(lm, args.workload, None, args.problems, (), on_call, "calls", True, args.offset)
    return calls


def main() -> None:
    ap = calls_parser(__doc__.splitlines()[0], problems=20, path_tokens=False)
    ap.add_argument("--ratio", type=float, default=0.05, help="share of span tokens recomputed (span_mean's sources)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    calls = collect(lm, args)
    num_layers = lm.config.num_layers - FROM_LAYER
    sums: dict[str, list[float]] = {}  # "kv/estimator" -> [<D,P>, |P|^2, |D|^2]

    def add(key: str, move: torch.Tensor, estimate: torch.Tensor) -> None:
        s = sums.setdefault(key, [0.0, 0.0, 0.0])
        s[0] += float((move * estimate).sum())
        s[1] += float(estimate.pow(2).sum())
        s[2] += float(move.pow(2).sum())

    for ci, c in enumerate(calls):
        others = [o for o in calls if o.problem != c.problem]
        # the cheap form: per role, the top TOP_K pool tokens by the cosine of all KV heads' keys at one layer,
        # softmax(cos / 0.02) over them, the same weights at every layer and head
        cheap: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor, list]] = {}
        for role in sorted(set(c.role_of)):
            rows = torch.tensor([r == role for r in c.role_of])
            pool = [(o, torch.tensor([r == role for r in o.role_of])) for o in others]
            pool = [(o, rm) for o, rm in pool if rm.any()]
            if not pool:
                continue
            for ml in MATCH_LAYERS:
                qk = c.k_used[ml - FROM_LAYER][:, rows].float().transpose(0, 1).flatten(1)  # [rows, Hkv * hd]
                pk = torch.cat([o.k_used[ml - FROM_LAYER][:, rm].float().transpose(0, 1).flatten(1)
                                for o, rm in pool])  # [P, Hkv * hd]
                sim = torch.nn.functional.normalize(qk, dim=-1) @ torch.nn.functional.normalize(pk, dim=-1).T
                top = sim.topk(min(TOP_K, sim.shape[1]), dim=-1)
                cheap[role, ml] = (top.indices, torch.softmax(top.values / 0.02, -1), pool)
        for li in range(num_layers):
            tmask = c.target_mask[li]
            for kv in ("k", "v"):
                moves = (c.k_move if kv == "k" else c.v_move)[li].float()  # [Hkv, m, hd]
                move_t = moves[:, tmask]
                shape = move_t.shape
                preds: dict[str, torch.Tensor] = {}
                roles = sorted(set(c.role_of))
                x_role = torch.zeros_like(moves)
                x_place = torch.zeros_like(moves)
                x_token = torch.zeros_like(moves)
                x_knn = {t: torch.zeros_like(moves) for t in TEMPERATURES}
                for role in roles:
                    rows = torch.tensor([r == role for r in c.role_of])
                    pool = [(o, torch.tensor([r == role for r in o.role_of])) for o in others]
                    pool = [(o, rm) for o, rm in pool if rm.any()]
                    if not pool:
                        continue
                    pm = torch.cat([(o.k_move if kv == "k" else o.v_move)[li][:, rm].float() for o, rm in pool], 1)
                    pk = torch.cat([o.k_used[li][:, rm].float() for o, rm in pool], 1)  # [Hkv, P, hd]
                    pids = torch.cat([o.token_ids[rm] for o, rm in pool])
                    pplace = torch.cat([o.place[rm] for o, rm in pool])
                    mean = pm.mean(1, keepdim=True)
                    x_role[:, rows] = mean
                    x_place[:, rows] = by_group(c.place[rows], pplace, pm,
                                                lambda r, s, pm=pm: pm[:, s].mean(1, keepdim=True),
                                                (moves.shape[0], int(rows.sum()), moves.shape[2]))
                    x_token[:, rows] = by_group(c.token_ids[rows], pids, pm,
                                                lambda r, s, pm=pm: pm[:, s].mean(1, keepdim=True),
                                                (moves.shape[0], int(rows.sum()), moves.shape[2]))
                    # by_group falls back to the pool's mean: that is x_role, as wanted
                    qk = torch.nn.functional.normalize(c.k_used[li][:, rows].float(), dim=-1)
                    sim = qk @ torch.nn.functional.normalize(pk, dim=-1).mT  # [Hkv, rows, P]
                    for t in TEMPERATURES:
                        x_knn[t][:, rows] = torch.softmax(sim / t, -1) @ pm
                for ml in MATCH_LAYERS:
                    est = torch.zeros_like(moves)
                    for role in roles:
                        if (role, ml) not in cheap:
                            continue
                        idx, w, pool = cheap[role, ml]
                        rows = torch.tensor([r == role for r in c.role_of])
                        pm = torch.cat([(o.k_move if kv == "k" else o.v_move)[li][:, rm].float() for o, rm in pool],
                                       1)  # [Hkv, P, hd]
                        # [Hkv, rows, k, hd] -> [Hkv, rows, hd]
                        est[:, rows] = (pm[:, idx] * w[None, :, :, None]).sum(2)
                    preds[f"x_top{TOP_K}@L{ml}"] = est[:, tmask]
                # within-call: the top share's mean move in the token's span
                src = ~tmask
                span_mean = by_group(c.span_of[tmask], c.span_of[src], moves[:, src],
                                     lambda r, s, ms=moves[:, src]: ms[:, s].mean(1, keepdim=True), shape)
                preds["x_role"] = x_role[:, tmask]
                preds["x_place"] = x_place[:, tmask]
                preds["x_token"] = x_token[:, tmask]
                for t in TEMPERATURES:
                    preds[f"x_knn@{t}"] = x_knn[t][:, tmask]
                preds["span_mean"] = span_mean
                preds["span_mean+x_token"] = span_mean + (x_token - x_role)[:, tmask]
                preds["span_mean+x_knn"] = span_mean + (x_knn[0.02] - x_role)[:, tmask]
                for name, estimate in preds.items():
                    add(f"{kv}/{name}", move_t, estimate)
        print(f"call {ci + 1}/{len(calls)} scored", flush=True)

    summary = {}
    for key, (dp, pp, dd) in sums.items():
        summary[key] = {"best_scale": dp / pp if pp else 0.0, "explained_at_best": dp * dp / (pp * dd) if pp else 0.0,
                        "explained_at_1": (2 * dp - pp) / dd}
    Path(args.json).write_text(json.dumps({
        "model": lm.name, "workload": args.workload, "offset": args.offset, "problems": args.problems,
        "num_calls": len(calls), "ratio": args.ratio, "from_layer": FROM_LAYER, "environment": environment("cpu"),
        "summary": summary}, indent=1) + "\n")
    print(f"{len(calls)} calls; share of the targets' squared move explained (best scale, at 1)")
    for key, s in summary.items():
        print(f"  {key:22s} {s['explained_at_best']:.3f} (x{s['best_scale']:+.2f})  {s['explained_at_1']:+.3f}")


if __name__ == "__main__":
    main()
