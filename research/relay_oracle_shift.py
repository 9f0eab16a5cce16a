"""How far can moving the K/V of the span tokens a selection does not recompute take it? Oracle selections with
oracle and estimated corrections, on calibration (train) calls, first token against ``full``.

The selection is ``relay_oracle.py``'s (the new tokens plus the top share of the span tokens by their true key move,
recomputed at every layer). At every layer from 1 up, the K/V of the span tokens it leaves are moved before
attention reads them (``KVShift``, keys with RoPE undone, as relay's ``drift`` adds them). The true move of a
token is its fresh prefill's K/V minus the loaded (re-rotated, unrepaired) one:

- ``none``: no move (the plain oracle);
- ``exact``: each token's own true move (every K/V equals the fresh prefill's: a check of the machinery, KL ~0);
- ``span mean``: the mean true move of the token's span, every token of it included (session 21's drift oracle);
- ``recomputed mean xA``: A x the mean true move of the recomputed tokens (relay's drift reads the move of the tokens
  it recomputes; here they are the oracle's tokens and their move is read from the fresh prefill, so this is an
  optimistic stand-in for it);
- ``recomputed span mean xA``: the same within the token's span (the mean of all recomputed tokens for a span with
  none recomputed).

Usage: python research/relay_oracle_shift.py --problems 20 --offset 100 --ratios 0,0.045,0.1 --json OUT.json
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from relay_drift_study import by_group
from relay_oracle import ORACLE_FROM_LAYER, fresh_prefill, loaded_cache, schedule_logits
from relay_train_points import calls_parser

from kvrelay.cache.kv import SequenceKV
from kvrelay.cache.store import KVStore
from kvrelay.eval.calibration_calls import downstream_calls
from kvrelay.eval.fidelity import first_token_agrees, kl_first_token
from kvrelay.eval.harness import environment
from kvrelay.model.rope import undo_rotary
from kvrelay.model.schedule import KVShift, LayerView, StaticSchedule
from kvrelay.model.transformer import PrefillResult
from kvrelay.reuse.base import CallInput
from kvrelay.reuse.spans import ReusePlan, collect_reuse
from kvrelay.weights.loader import load_model

MEAN_SCALES = (0.15, 0.35)  # relay_drift_study's best single scale near a 5% share, and SmolLM2's shipped drift


class ShiftedStatic(StaticSchedule):
    """``active_idx`` computed at every layer; at each layer of ``shifts`` (layer -> (prompt positions, K before RoPE,
    V), [Hkv, m, hd] each) those positions' cached K/V move by the given amounts before attention reads them."""

    has_layer_hook = True

    def __init__(self, active_idx: torch.Tensor,
                 shifts: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        super().__init__(active_idx)
        self.shifts = shifts

    def selects_before_attention(self, layer: int) -> bool:
        return layer in self.shifts

    def adjust_kv(self, view: LayerView) -> KVShift | None:
        return KVShift(*self.shifts[view.layer])


def span_call(lm, call: CallInput, store: KVStore) -> tuple[ReusePlan, PrefillResult, SequenceKV] | None:
    """A scored call's reuse plan and its fresh prefill (result, cache), or None where it relays no span token."""
    reuse = collect_reuse(call, store, lm.fingerprint)
    if not reuse.approx_idx().numel():
        return None
    return reuse, *fresh_prefill(lm, call)


def moved_logits(lm, call: CallInput, store: KVStore, reuse: ReusePlan, k_move: torch.Tensor, v_move: torch.Tensor
                 ) -> torch.Tensor:
    """First-token logits with the call's new tokens computed and every approximate span token's loaded K/V moved by
    (k_move, v_move) [L, Hkv, m, hd] (keys before RoPE) at layers 1 up."""
    span_idx, new_idx = reuse.approx_idx(), reuse.new_idx(len(call.prompt_ids))
    shifts = {layer: (span_idx, k_move[layer], v_move[layer]) for layer in range(1, lm.config.num_layers)}
    return schedule_logits(lm, call, store, ShiftedStatic(new_idx, shifts), reuse.loads)[0]


def moves(lm, call: CallInput, store: KVStore, reuse: ReusePlan, fresh: SequenceKV
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """True moves of the approximate span tokens, fresh - loaded: K with RoPE undone and V, [L, Hkv, m, hd] each."""
    n, span_idx = len(call.prompt_ids), reuse.approx_idx()
    loaded = loaded_cache(lm, call, store, reuse.loads)
    dk, dv = [], []
    for layer in range(lm.config.num_layers):
        cos, sin = lm.model.rope_of(layer).cos_sin(span_idx, torch.float32, n)
        dk.append(undo_rotary(fresh.k[layer][:, span_idx].float() - loaded.k[layer][:, span_idx].float(), cos, sin))
        dv.append(fresh.v[layer][:, span_idx].float() - loaded.v[layer][:, span_idx].float())
    return torch.stack(dk), torch.stack(dv)  # L x [Hkv, m, hd] -> [L, Hkv, m, hd]


def corrections(dk: torch.Tensor, dv: torch.Tensor, chosen: torch.Tensor, span_of: torch.Tensor
                ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> the (K, V) moves [L, Hkv, t, hd] given to the tokens not ``chosen`` (bool [m]), per the docstring."""
    left = ~chosen
    out = {"exact": (dk[:, :, left], dv[:, :, left])}

    def by_span(d: torch.Tensor, among: torch.Tensor) -> torch.Tensor:
        """[L, Hkv, t, hd]: each target's span mean over ``among`` (never empty), else the mean over all of it."""
        pool = d[:, :, among]  # [L, Hkv, sources, hd]
        return by_group(span_of[left], span_of[among], pool, lambda rows, src: pool[:, :, src].mean(2, keepdim=True),
                        d[:, :, left].shape)

    every = torch.ones_like(chosen)
    out["span mean"] = (by_span(dk, every), by_span(dv, every))
    for scale in MEAN_SCALES:
        if chosen.any():
            mean_k, mean_v = dk[:, :, chosen].mean(2, keepdim=True), dv[:, :, chosen].mean(2, keepdim=True)
            out[f"recomputed mean x{scale}"] = (scale * mean_k.expand_as(dk[:, :, left]),
                                                scale * mean_v.expand_as(dv[:, :, left]))
            out[f"recomputed span mean x{scale}"] = (scale * by_span(dk, chosen), scale * by_span(dv, chosen))
    return out


def main() -> None:
    ap = calls_parser(__doc__.splitlines()[0], problems=20, path_tokens=False)
    ap.add_argument("--ratios", default="0,0.045,0.1", help="shares of the span tokens recomputed, a comma list")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    num_layers = lm.config.num_layers
    ratios = tuple(float(r) for r in args.ratios.split(","))
    rows: dict[str, list[dict]] = {}

    def on_call(call, store) -> None:
        n = len(call.prompt_ids)
        reuse = collect_reuse(call, store, lm.fingerprint)
        span_idx = reuse.approx_idx()
        if not span_idx.numel():
            return
        span_of = torch.cat([torch.full((ld.num_tokens,), i) for i, ld in enumerate(reuse.approx)])
        full, fresh = fresh_prefill(lm, call)
        dk, dv = moves(lm, call, store, reuse, fresh)
        key_move = dk[ORACLE_FROM_LAYER:].norm(dim=-1).pow(2).sum(1).sqrt().mean(0)  # [m]: relay_oracle's ranking
        new_idx = reuse.new_idx(n)
        for ratio in ratios:
            chosen = torch.zeros(span_idx.numel(), dtype=torch.bool)
            if ratio > 0:
                chosen[key_move.topk(max(1, round(ratio * span_idx.numel()))).indices] = True
            active = torch.cat([new_idx, span_idx[chosen]]).unique()
            fixes = {"none": None, **corrections(dk, dv, chosen, span_of)}
            for name, fix in fixes.items():
                shifts = {} if fix is None else {layer: (span_idx[~chosen], fix[0][layer], fix[1][layer])
                                                 for layer in range(1, num_layers)}
                logits, reuse_rate = schedule_logits(lm, call, store, ShiftedStatic(active, shifts), reuse.loads)
                rows.setdefault(f"{ratio} {name}", []).append({
                    "kl": kl_first_token(full.logits, logits), "reuse": reuse_rate,
                    "agree": first_token_agrees(full.logits, logits)})

    downstream_calls(lm, args.workload, None, args.problems, (), on_call, "calls", True, args.offset)
    summary = {name: {k: sum(float(r[k]) for r in rs) / len(rs) for k in ("kl", "reuse", "agree")}
               for name, rs in rows.items()}
    Path(args.json).write_text(json.dumps({
        "model": lm.name, "workload": args.workload, "offset": args.offset, "problems": args.problems,
        "ratios": ratios, "environment": environment("cpu"), "summary": summary, "calls": rows}, indent=1) + "\n")
    for name, s in summary.items():
        print(f"{name:32s} reuse {s['reuse']:.3f}  first token {s['agree']:.3f}  KL {s['kl']:.4f}")


if __name__ == "__main__":
    main()
