"""Can the span tokens relay recomputes predict how the others' K/V move? Per layer, on calibration (train) calls.

Relay's ``drift`` adds a share of the recomputed span tokens' mean K/V move (fresh - reused, keys with RoPE undone)
to the span tokens it does not recompute. This study asks how much of those tokens' true move any estimate built
from the recomputed tokens' moves could recover, i.e. whether a per-token correction that costs no token-layers
is there to be had. For each downstream call the true move of every approximate span token at every layer from 2
up is read from a full prefill against the loaded (re-rotated, unrepaired) K/V. The ``--ratios`` share of them
with the largest value deviation at that layer (what relay's pruning keeps) are the sources; the rest are the
targets. Each predictor estimates the targets' moves from the sources' (per KV head):

- ``mean``: the sources' mean move (relay's ``drift``);
- ``span_mean``: the mean over the sources in the target's own span (else all);
- ``near4``: the mean over the 4 sources nearest in position in the target's span (else all);
- ``kernel_k@t`` / ``kernel_v@t``: a softmax (temperature t) over the cosine similarity of the target's reused
  key (RoPE undone) / value to each source's, weighting the sources' moves;
- ``mean_by_away``: the sources' mean move scaled, per target, by its lost attention mass over the sources' mean
  mass (``away_mass`` at layer 2 from a fresh prefill of the stored sequence: tokens that read more of the context
  they lost should move more);
- ``ridge``: the sources' mean move plus a linear map from a token's reused key or value to the rest of its move,
  fitted on the sources by ridge regression (``ridge@p``: penalty p; a per-call, per-layer, per-head linear
  correction).

Reported per (share, K or V, predictor), pooled over calls, layers and heads: the share of the targets' squared
move the predictor explains at the best single scale (``<D,P>^2 / (|P|^2 |D|^2)``), that scale, and the share it
explains at scale 0.35 (SmolLM2's shipped ``drift``; negative when the estimate adds more error than it removes).

Usage: python research/relay_drift_study.py --problems 20 --offset 100 --ratios 0.05,0.1,0.3 --json OUT.json
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from relay_oracle import fresh_prefill, loaded_cache
from relay_oracle_signals import fresh_away_mass
from relay_train_points import calls_parser

from kvrelay.eval.calibration_calls import downstream_calls
from kvrelay.eval.harness import environment
from kvrelay.model.rope import undo_rotary
from kvrelay.reuse.spans import collect_reuse
from kvrelay.weights.loader import load_model

FROM_LAYER = 2  # the layers a band can start at and above; the lost mass is read there too
TEMPERATURES = (0.05, 0.2)
SHIPPED_DRIFT = 0.35
RIDGE_PENALTIES = (0.1, 1.0)  # in units of the sources' mean squared feature norm (about d / ns of the mean eigenvalue)


def kernel(target_feat: torch.Tensor, source_feat: torch.Tensor, source_move: torch.Tensor, t: float) -> torch.Tensor:
    """[H, nt, d]: each target's softmax(cos / t)-weighted mean of the sources' moves (feats [H, n, d])."""
    sim = torch.nn.functional.normalize(target_feat, dim=-1) @ torch.nn.functional.normalize(source_feat, dim=-1).mT
    return torch.softmax(sim / t, -1) @ source_move  # [H, nt, ns] @ [H, ns, d]


def ridge(target_feat: torch.Tensor, source_feat: torch.Tensor, source_move: torch.Tensor, penalty: float
          ) -> torch.Tensor:
    """[H, nt, d]: per head, the sources' mean move plus a linear map of the feature's offset from their mean
    feature, fitted on the sources by ridge regression (the mean itself not shrunk)."""
    feat_mean, move_mean = source_feat.mean(1, keepdim=True), source_move.mean(1, keepdim=True)
    xs = source_feat - feat_mean  # [H, ns, d]
    lam = penalty * xs.pow(2).sum(-1).mean()
    gram = xs.mT @ xs + lam * torch.eye(xs.shape[-1])  # [H, d, d]
    return move_mean + (target_feat - feat_mean) @ torch.linalg.solve(gram, xs.mT @ (source_move - move_mean))


def by_group(groups_t: torch.Tensor, groups_s: torch.Tensor, move_s: torch.Tensor,
             estimate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], shape: torch.Size | tuple[int, ...]
             ) -> torch.Tensor:
    """[..., nt, d]: per target group, ``estimate(target rows, source rows)`` over the sources of the same group, else
    the sources' mean (tokens on the second-to-last dimension of ``move_s`` [..., ns, d] and of ``shape``)."""
    out = move_s.mean(-2, keepdim=True).expand(shape).clone()
    for g in groups_t.unique():
        rows, src = (groups_t == g).nonzero().flatten(), (groups_s == g).nonzero().flatten()
        if src.numel():
            out[..., rows, :] = estimate(rows, src)
    return out


def main() -> None:
    ap = calls_parser(__doc__.splitlines()[0], problems=20, path_tokens=False)
    ap.add_argument("--ratios", default="0.05,0.1,0.3", help="shares of span tokens recomputed, a comma list")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    ratios = tuple(float(r) for r in args.ratios.split(","))
    sums: dict[str, list[float]] = {}  # "share/kv/predictor" -> [<D,P>, |P|^2, |D|^2]
    num_calls = 0

    def add(key: str, move: torch.Tensor, estimate: torch.Tensor) -> None:
        s = sums.setdefault(key, [0.0, 0.0, 0.0])
        s[0] += float((move * estimate).sum())
        s[1] += float(estimate.pow(2).sum())
        s[2] += float(move.pow(2).sum())

    def on_call(call, store) -> None:
        nonlocal num_calls
        n = len(call.prompt_ids)
        reuse = collect_reuse(call, store, lm.fingerprint)
        span_idx = reuse.approx_idx()
        if not span_idx.numel():
            return
        num_calls += 1
        span_of = torch.cat([torch.full((ld.num_tokens,), i) for i, ld in enumerate(reuse.approx)])
        place = torch.cat([torch.arange(ld.num_tokens) for ld in reuse.approx]).float()  # a token's place in its span
        _, fresh = fresh_prefill(lm, call)
        loaded = loaded_cache(lm, call, store, reuse.loads)
        m = span_idx.numel()
        lost_mass = torch.cat([fresh_away_mass(lm, list(store.get(ld.span_id).token_ids), ld.src_start, ld.src_end,
                                          (FROM_LAYER,))[FROM_LAYER] for ld in reuse.approx]).float()  # [m]
        for layer in range(FROM_LAYER, lm.config.num_layers):
            cos, sin = lm.model.rope_of(layer).cos_sin(span_idx, torch.float32, n)
            k_fresh = undo_rotary(fresh.k[layer][:, span_idx].float(), cos, sin)  # [Hkv, m, hd]
            k_used = undo_rotary(loaded.k[layer][:, span_idx].float(), cos, sin)
            v_fresh, v_used = fresh.v[layer][:, span_idx].float(), loaded.v[layer][:, span_idx].float()
            v_dev = 1 - torch.nn.functional.cosine_similarity(v_fresh.transpose(0, 1).flatten(1),
                                                              v_used.transpose(0, 1).flatten(1), dim=-1)  # [m]
            for ratio in ratios:
                num_src = max(1, round(ratio * m))
                if num_src >= m:
                    continue
                src = torch.zeros(m, dtype=torch.bool)
                src[v_dev.topk(num_src).indices] = True
                for kv, move, feat in (("k", k_fresh - k_used, k_used), ("v", v_fresh - v_used, v_used)):
                    move_t, move_s = move[:, ~src], move[:, src]  # [Hkv, targets, hd], [Hkv, sources, hd]
                    shape = move_t.shape
                    preds = {"mean": move_s.mean(1, keepdim=True).expand(shape),
                             "span_mean": by_group(span_of[~src], span_of[src], move_s,
                                                   lambda rows, s, ms=move_s: ms[:, s].mean(1, keepdim=True), shape)}

                    def near(rows, s, pt=place[~src], ps=place[src], ms=move_s):
                        dist = (pt[rows, None] - ps[None, s]).abs()  # [rows, sources of the span]
                        return ms[:, s[dist.topk(min(4, s.numel()), largest=False).indices]].mean(2)

                    preds["near4"] = by_group(span_of[~src], span_of[src], move_s, near, shape)
                    for t in TEMPERATURES:
                        preds[f"kernel_k@{t}"] = kernel(k_used[:, ~src], k_used[:, src], move_s, t)
                        preds[f"kernel_v@{t}"] = kernel(v_used[:, ~src], v_used[:, src], move_s, t)
                    weight = lost_mass[~src] / lost_mass[src].mean().clamp_min(1e-6)  # [targets]
                    preds["mean_by_away"] = move_s.mean(1, keepdim=True) * weight[None, :, None]
                    for penalty in RIDGE_PENALTIES:
                        preds[f"ridge@{penalty}"] = ridge(feat[:, ~src], feat[:, src], move_s, penalty)
                    for name, estimate in preds.items():
                        add(f"{ratio}/{kv}/{name}", move_t, estimate)

    downstream_calls(lm, args.workload, None, args.problems, (), on_call, "calls", True, args.offset)
    summary = {}
    for key, (dp, pp, dd) in sums.items():
        summary[key] = {"best_scale": dp / pp if pp else 0.0, "explained_at_best": dp * dp / (pp * dd) if pp else 0.0,
                        "explained_at_shipped": (2 * SHIPPED_DRIFT * dp - SHIPPED_DRIFT ** 2 * pp) / dd}
    Path(args.json).write_text(json.dumps({
        "model": lm.name, "workload": args.workload, "offset": args.offset, "problems": args.problems,
        "num_calls": num_calls, "ratios": ratios, "from_layer": FROM_LAYER, "environment": environment("cpu"),
        "summary": summary}, indent=1) + "\n")
    print(f"{num_calls} calls; share of the targets' squared move explained (best scale, at {SHIPPED_DRIFT})")
    for key, s in summary.items():
        print(f"  {key:22s} {s['explained_at_best']:.3f} (x{s['best_scale']:+.2f})  {s['explained_at_shipped']:+.3f}")


if __name__ == "__main__":
    main()
