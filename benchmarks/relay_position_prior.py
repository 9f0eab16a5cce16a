"""Relay admitting span tokens by influence plus a position prior (a span's early tokens first), on train calls.

``relay_oracle_signals.py`` found that a span token's position alone recovers more of the oracle's tokens (61%
of its top 20%) than the influence relay admits by (35%). Here relay's admission (L_det = L_start) ranks the
entering tokens by influence / its mean + ``weight`` x prior / its mean, prior = 1 / (1 + position in span /
``scale``), and keeps the top ``top_r`` share; the rest of relay (openings at every layer, pruning, drift) is
unchanged. Each point is held to full's continuation beside epic, as ``relay_train_points.py`` scores.

Usage: python benchmarks/relay_position_prior.py --model smollm2-135m --offset 100 --problems 20
    --points POINTS.json --json OUT.json
POINTS.json: {"name": {relay knob: value, ..., "weight": w, "scale": s}}; the relay knobs must admit at L_start
(l_det = l_start) with ``pre_dense`` openings and ``l_suf`` 0 (so no entering token is always kept).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from relay_train_points import calls_parser, load_points

from kvrelay.eval.calibration_calls import score_methods
from kvrelay.eval.harness import environment
from kvrelay.model.schedule import LayerView
from kvrelay.reuse.base import CallInput, Plan
from kvrelay.reuse.epic import EpicMethod
from kvrelay.reuse.relay import RelayMethod
from kvrelay.reuse.spans import collect_reuse
from kvrelay.weights.loader import load_model


@dataclass
class PositionPriorRelay(RelayMethod):
    weight: float = 1.0
    scale: float = 16.0

    def plan(self, call: CallInput, store, lm) -> Plan:
        plan = super().plan(call, store, lm)
        schedule = plan.schedule
        if getattr(schedule, "_admit", None) is None:
            raise SystemExit("the point must admit at L_start (l_det = l_start, every span carried)")
        sel = self.selector_settings(lm, call.role)  # as it runs (a knob left out takes the paper's value)
        if sel.l_suf or not sel.pre_dense:  # this admission keeps no span end: relay's pruning counts on that
            raise SystemExit("the point must set l_suf=0 and pre_dense (no entering token is always kept)")
        n = len(call.prompt_ids)
        reuse = collect_reuse(call, store, lm.fingerprint)
        position = torch.zeros(n)  # by prompt position: the token's place in its span
        for ld in reuse.approx:
            position[ld.dst_start : ld.dst_start + ld.num_tokens] = torch.arange(ld.num_tokens, dtype=torch.float32)
        is_new = torch.zeros(n, dtype=torch.bool)
        is_new[reuse.new_idx(n)] = True
        top_r, weight, scale = self.top_r, self.weight, self.scale

        def admit(view: LayerView, entering_idx: torch.Tensor) -> torch.Tensor:
            rows = is_new.index_select(0, view.active_idx).nonzero().flatten()  # the call's own new tokens
            influence = view.attention_probs(rows).sum(dim=(0, 1)).index_select(0, entering_idx).float()
            prior = 1 / (1 + position.index_select(0, entering_idx) / scale)
            score = influence / influence.mean().clamp_min(1e-12) + weight * prior / prior.mean()
            keep = torch.zeros(entering_idx.numel(), dtype=torch.bool)
            num_keep = round(top_r * entering_idx.numel())
            if num_keep:
                keep[score.topk(num_keep).indices] = True
            return keep

        schedule._admit = admit
        return plan


def main() -> None:
    ap = calls_parser(__doc__.splitlines()[0], problems=20)
    ap.add_argument("--points", required=True, help="JSON file: name -> relay knobs, weight and scale")
    ap.add_argument("--data", help="problems file (default: GSM8K train for GSM8K workloads, else the workload's "
                    "own); a test file holds out points chosen on train")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    points, methods = load_points(args.points, PositionPriorRelay)  # a one-line exit on a bad file or point
    methods = {"epic": EpicMethod(), **methods}
    lm = load_model(args.model)
    scores = score_methods(lm, methods, args.workload, args.data, args.problems, "points", True, args.path_tokens,
                           args.offset)
    Path(args.json).write_text(json.dumps({
        "model": lm.name, "workload": args.workload, "data": args.data, "offset": args.offset,
        "problems": args.problems, "path_tokens": args.path_tokens, "points": points, "environment": environment("cpu"),
        "scores": {name: score._asdict() for name, score in scores.items()}}, indent=1) + "\n")
    epic = scores["epic"]
    for name, score in scores.items():
        print(f"{name:44s} reuse {score.reuse / epic.reuse:.3f}x  KL {score.kl / epic.kl:.2f}x  "
              f"path KL {score.path_kl / epic.path_kl:.2f}x  greedy {score.greedy:.3f}")


if __name__ == "__main__":
    main()
