"""The band's size per call (``relay_anchors[anchor_tau=t]``) against a fixed share, on calibration calls.

A fixed ``top_r`` recomputes the same share of every call's span tokens. With ``anchor_tau`` a call recomputes as many
as its anchors expect to miss more than ``t`` (squared move), ranked as before: calls whose spans the anchors know
badly get more of the band, the others less. This script teaches one blended ``relay_anchors`` pool (``anchor_blend``
0.5) on ``--pool-problems`` problems from ``--pool-offset``, reads every scored call's expected misses (``--problems``
from ``--offset``), sets one ``t`` per share in ``--shares`` as the quantile of those misses above which that share of
all span tokens lies, and scores each ``anchor_tau`` beside the fixed shares ``--top-r``: first-token KL against
``full`` on the same prompt ids (mean, median), and the span token-layers recomputed per call (mean, median, 90th
percentile: the band's cost, which sets a call's TTFT).

Usage: python research/relay_anchor_tau.py --problems 20 --offset 100 --pool-offset 120 --pool-problems 128 \\
    --top-r 0.055,0.06 --shares 0.05,0.06 --json OUT.json
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch
from relay_anchor_blend import floats, score_calls
from relay_anchor_select import ANCHOR_BAND, ONE, open_pool_study, pool_parser

from kvrelay.engine import Engine, GenerateOptions
from kvrelay.eval.calibration_calls import downstream_calls
from kvrelay.eval.harness import environment
from kvrelay.reuse import get_method
from kvrelay.reuse.relay_anchors import RelayAnchorsMethod
from kvrelay.reuse.spans import collect_reuse

BLEND = "anchor_blend=0.5"


def expected_misses(method: RelayAnchorsMethod, lm, call, store) -> torch.Tensor:
    """The squared move ``method``'s estimate is expected to miss, per approximate span token of ``call`` [m]."""
    reuse = collect_reuse(call, store, lm.fingerprint)
    parts = []
    for load, role in zip(reuse.approx, method.roles(call, reuse.approx), strict=True):
        estimate = method._estimate(role, store.get(load.span_id), load, lm)
        if estimate is not None:
            parts.append(estimate[2].cpu())
    return torch.cat(parts) if parts else torch.empty(0)


def tau_for_share(misses: torch.Tensor, share: float) -> float:
    """The expected miss above which ``share`` of ``misses`` lie."""
    return float(torch.quantile(misses.double(), 1 - share))


def main() -> None:
    ap = pool_parser(__doc__.splitlines()[0])
    ap.add_argument("--top-r", default="0.06", help="fixed band shares scored beside, a comma list")
    ap.add_argument("--shares", default="0.05,0.06", help="overall shares whose thresholds are scored, a comma list")
    args, lm, start, capture = open_pool_study(ap)
    try:
        fixed, shares = floats(args.top_r), floats(args.shares)
    except ValueError as exc:
        ap.error(f"--top-r and --shares take comma lists of numbers ({exc})")
    if not all(0 < r < 1 for r in fixed + shares):
        ap.error("--top-r and --shares must be in (0, 1)")
    top = lm.config.num_layers - 1
    calls = f"anchor_calls={args.pool_problems}"

    def spec(r: float, extra: str = "") -> str:
        return f"relay_anchors[{calls},{ANCHOR_BAND.format(start=start, top=top, r=r)},{BLEND}{extra}]"

    teacher = get_method(spec(fixed[0]))
    downstream_calls(lm, args.workload, None, args.pool_problems, capture,
                     lambda call, store: Engine(lm, store, capture_layers=capture).generate(
                         call, teacher, GenerateOptions(ONE.sampling, learn=True)),
                     "pool", True, args.pool_offset)
    found: list[torch.Tensor] = []
    downstream_calls(lm, args.workload, None, args.problems, capture,
                     lambda call, store: found.append(expected_misses(teacher, lm, call, store)),
                     "misses", True, args.offset)
    misses = torch.cat(found)
    taus = {share: tau_for_share(misses, share) for share in shares}
    methods = {"relay": get_method("relay")}
    for r in fixed:
        methods[f"top_r={r}"] = get_method(spec(r))
    for share, tau in taus.items():
        methods[f"anchor_tau={tau:.6g} (share {share})"] = get_method(spec(fixed[0], f",anchor_tau={tau:.6g}"))
    for name, method in methods.items():
        if name != "relay":
            method.pool, method.readout = teacher.pool, teacher.readout
    kls, recomputed = score_calls(lm, args, methods, capture)

    def p90(values: list[int]) -> float:
        return float(torch.quantile(torch.tensor(values, dtype=torch.float64), 0.9))

    summary = {name: {"kl_mean": statistics.mean(v), "kl_median": statistics.median(v),
                      "below_relay": sum(a < b for a, b in zip(v, kls["relay"], strict=True)),
                      "recomputed_mean": statistics.mean(recomputed[name]),
                      "recomputed_median": statistics.median(recomputed[name]), "recomputed_p90": p90(recomputed[name])}
               for name, v in kls.items()}
    Path(args.json).write_text(json.dumps({
        "model": lm.name, "workload": args.workload, "offset": args.offset, "problems": args.problems,
        "pool_offset": args.pool_offset, "pool_problems": args.pool_problems, "top_r": fixed, "shares": shares,
        "taus": {str(s): t for s, t in taus.items()}, "environment": environment("cpu"), "summary": summary,
        "calls": kls, "recomputed": recomputed}, indent=1) + "\n")
    for name, s in summary.items():
        print(f"{name:40s} KL {s['kl_mean']:.5f} median {s['kl_median']:.5f} below relay {s['below_relay']:3d}  "
              f"recomputed mean {s['recomputed_mean']:.0f} median {s['recomputed_median']:.0f} "
              f"p90 {s['recomputed_p90']:.0f}")


if __name__ == "__main__":
    main()
