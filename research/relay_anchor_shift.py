"""Cross-call anchors as a correction: the oracle selection's left-over span tokens moved by their anchors' moves,
first token against ``full``, on calibration (train) calls.

``relay_anchor_study.py`` measures how much of a span token's true K/V move the moves of similar tokens in the same role
of *other* problems explain. This script puts that estimate into the forward. A pool is built from the calls of
``--pool-offset``/``--pool-problems`` (problems no scored call comes from): per role (the agent called, the index of the
span among its approximate spans) and layer, every span token's loaded key (RoPE undone) and its true K/V move. On each
scored call, a span token's anchor move at a layer and KV head is the softmax(cos / ``--temperature``)-weighted mean of
the moves of all the same role's pool tokens, by the cosine of their loaded keys at that layer and head (free: the
loaded K is in the store). That is the study's ``x_knn``, not the cheaper form ``relay_anchors`` ships (the 8 nearest by
one match at the middle layer, the same weights at every layer and head), which ``kvrelay bench`` measures. The
selection is ``relay_oracle_shift.py``'s (the new tokens plus the top share of span tokens by their true key move,
recomputed at every layer, ``oracle``), or the top share by the key move left after the anchors (``oracle-residual``);
the tokens it leaves are moved (``KVShift`` at every layer from 1) by:

- ``none``: nothing (the plain oracle, and at share 0 ``naive``);
- ``anchors xA``: A x their anchor moves.

Usage: python research/relay_anchor_shift.py --problems 20 --offset 100 --pool-offset 120 --json OUT.json
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from relay_oracle import ORACLE_FROM_LAYER, fresh_prefill, loaded_cache, schedule_logits
from relay_oracle_shift import ShiftedStatic, moves, span_call
from relay_train_points import calls_parser

from kvrelay.cache.store import KVStore
from kvrelay.eval.calibration_calls import downstream_calls
from kvrelay.eval.fidelity import first_token_agrees, kl_first_token
from kvrelay.eval.harness import environment
from kvrelay.model.lm import LoadedModel
from kvrelay.model.rope import undo_rotary
from kvrelay.reuse.base import CallInput
from kvrelay.reuse.spans import ReusePlan, collect_reuse
from kvrelay.weights.loader import load_model

SCALES = (0.75, 1.0)


def roles_of(call: CallInput, reuse: ReusePlan) -> list[str]:
    """Per approximate span token: '<agent called>#<index of its span among the call's approximate spans>'."""
    return [f"{call.name}#{i}" for i, ld in enumerate(reuse.approx) for _ in range(ld.num_tokens)]


def loaded_keys(lm: LoadedModel, call: CallInput, store: KVStore, reuse: ReusePlan) -> torch.Tensor:
    """[L, Hkv, m, hd]: the approximate span tokens' loaded keys with RoPE undone."""
    n, span_idx = len(call.prompt_ids), reuse.approx_idx()
    loaded = loaded_cache(lm, call, store, reuse.loads)
    out = []
    for layer in range(lm.config.num_layers):
        cos, sin = lm.model.rope_of(layer).cos_sin(span_idx, torch.float32, n)
        out.append(undo_rotary(loaded.k[layer][:, span_idx].float(), cos, sin))
    return torch.stack(out)


def anchor_moves(feat: torch.Tensor, pool_feat: torch.Tensor, pool_dk: torch.Tensor, pool_dv: torch.Tensor,
                 temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) moves [L, Hkv, m, hd]: per layer and head, softmax(cos / t) over the pool tokens' keys weighting their
    moves (feat [L, Hkv, m, hd], pool tensors [L, Hkv, P, hd])."""
    sim = torch.nn.functional.normalize(feat, dim=-1) @ torch.nn.functional.normalize(pool_feat, dim=-1).mT
    w = torch.softmax(sim / temperature, -1)  # [L, Hkv, m, P]
    return w @ pool_dk, w @ pool_dv


def main() -> None:
    ap = calls_parser(__doc__.splitlines()[0], problems=20, path_tokens=False)
    ap.add_argument("--ratios", default="0,0.045,0.1", help="shares of the span tokens recomputed, a comma list")
    ap.add_argument("--pool-offset", type=int, default=120, help="the pool's problems start here (same data)")
    ap.add_argument("--pool-problems", type=int, default=20)
    ap.add_argument("--temperature", type=float, default=0.02)
    args = ap.parse_args()
    if args.pool_offset < args.offset + args.problems and args.offset < args.pool_offset + args.pool_problems:
        ap.error(f"the pool's problems [{args.pool_offset}, {args.pool_offset + args.pool_problems}) overlap the "
                 f"scored ones [{args.offset}, {args.offset + args.problems})")
    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    num_layers = lm.config.num_layers
    ratios = tuple(float(r) for r in args.ratios.split(","))
    pool: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    def on_pool_call(call, store) -> None:
        reuse = collect_reuse(call, store, lm.fingerprint)
        if not reuse.approx_idx().numel():
            return
        _, fresh = fresh_prefill(lm, call)
        dk, dv = moves(lm, call, store, reuse, fresh)
        feat = loaded_keys(lm, call, store, reuse)
        roles = roles_of(call, reuse)
        for role in set(roles):
            rows = torch.tensor([r == role for r in roles])
            pool.setdefault(role, []).append((feat[:, :, rows].half(), dk[:, :, rows].half(), dv[:, :, rows].half()))

    downstream_calls(lm, args.workload, None, args.pool_problems, (), on_pool_call, "pool", True, args.pool_offset)
    pools = {role: tuple(torch.cat([e[j] for e in entries], 2).float() for j in range(3))
             for role, entries in pool.items()}
    rows_out: dict[str, list[dict]] = {}

    def on_call(call, store) -> None:
        scored = span_call(lm, call, store)
        if scored is None:
            return
        reuse, full, fresh = scored
        span_idx = reuse.approx_idx()
        dk, dv = moves(lm, call, store, reuse, fresh)
        feat = loaded_keys(lm, call, store, reuse)
        roles = roles_of(call, reuse)
        ak, av = torch.zeros_like(dk), torch.zeros_like(dv)
        for role in set(roles):
            if role in pools:
                rows = torch.tensor([r == role for r in roles])
                ak[:, :, rows], av[:, :, rows] = anchor_moves(feat[:, :, rows], *pools[role], args.temperature)
        ak[0], av[0] = 0, 0  # layer 0's K/V depend on token and position only
        key_move = dk[ORACLE_FROM_LAYER:].norm(dim=-1).pow(2).sum(1).sqrt().mean(0)  # [m]
        residual = (dk - ak)[ORACLE_FROM_LAYER:].norm(dim=-1).pow(2).sum(1).sqrt().mean(0)
        new_idx = reuse.new_idx(len(call.prompt_ids))
        for ratio in ratios:
            for rank_name, rank in (("oracle", key_move), ("oracle-residual", residual)):
                if ratio == 0 and rank_name != "oracle":
                    continue
                chosen = torch.zeros(span_idx.numel(), dtype=torch.bool)
                if ratio > 0:
                    chosen[rank.topk(max(1, round(ratio * span_idx.numel()))).indices] = True
                active = torch.cat([new_idx, span_idx[chosen]]).unique()
                fixes = {"none": None, **{f"anchors x{s}": (s * ak[:, :, ~chosen], s * av[:, :, ~chosen])
                                          for s in SCALES}}
                for name, fix in fixes.items():
                    if rank_name != "oracle" and fix is None:
                        continue
                    shifts = {} if fix is None else {layer: (span_idx[~chosen], fix[0][layer], fix[1][layer])
                                                     for layer in range(1, num_layers)}
                    logits, reuse_rate = schedule_logits(lm, call, store, ShiftedStatic(active, shifts), reuse.loads)
                    rows_out.setdefault(f"{ratio} {rank_name} {name}", []).append({
                        "kl": kl_first_token(full.logits, logits), "reuse": reuse_rate,
                        "agree": first_token_agrees(full.logits, logits)})

    downstream_calls(lm, args.workload, None, args.problems, (), on_call, "calls", True, args.offset)
    summary = {name: {k: sum(float(r[k]) for r in rs) / len(rs) for k in ("kl", "reuse", "agree")}
               for name, rs in rows_out.items()}
    Path(args.json).write_text(json.dumps({
        "model": lm.name, "workload": args.workload, "offset": args.offset, "problems": args.problems,
        "pool_offset": args.pool_offset, "pool_problems": args.pool_problems, "temperature": args.temperature,
        "ratios": ratios, "pool_tokens": {r: int(p[0].shape[2]) for r, p in pools.items()},
        "environment": environment("cpu"), "summary": summary, "calls": rows_out}, indent=1) + "\n")
    for name, s in summary.items():
        print(f"{name:40s} reuse {s['reuse']:.3f}  first token {s['agree']:.3f}  KL {s['kl']:.4f}")


if __name__ == "__main__":
    main()
