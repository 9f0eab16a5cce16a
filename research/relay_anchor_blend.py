"""How to weigh ``relay_anchors``' two estimates: the blend's weight and the readout's penalty, on calibration calls.

``relay_anchors[anchor_blend=b]`` moves each span token by (1 - b) x its anchors' estimate plus b x a ridge readout of
its stored K/V (``move_readout``; penalty ``anchor_ridge`` x the features' mean variance). Session 35's study picked
b = 0.5 and a penalty of 0.1 from the share of the move explained; this script scores the methods as they run, with
relay's band on top, on calibration (train) calls. One ``relay_anchors`` pool learns through the method's own
learning calls on ``--pool-problems`` problems from ``--pool-offset``; the rows it keeps for the readout are kept
past its freeze, a readout is fitted per penalty in ``--ridges``, and every method shares the pool. Scored calls:
``--problems`` from ``--offset`` (none of them a pool problem). First-token KL against ``full`` on the same prompt
ids, mean over calls, with relay (shipped) beside.

``--top-r``, ``--starts`` and ``--tops`` (comma lists) score bands of several shares, first layers (``l_start`` =
``l_det``) and top layers (``l_end``) with every blend and penalty: a band that starts higher or stops below the last
layer recomputes fewer token-layers per token.

Usage: python research/relay_anchor_blend.py --problems 20 --offset 100 --pool-offset 120 --pool-problems 128 \\
    --top-r 0.06 --blends 0.5,0.65,0.8 --ridges 0.03,0.1,0.3 --json OUT.json
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from relay_anchor_select import ANCHOR_BAND, ONE, open_pool_study, pool_parser, scored_runs

from kvrelay.engine import Engine, GenerateOptions
from kvrelay.eval.calibration_calls import downstream_calls
from kvrelay.eval.fidelity import kl_first_token
from kvrelay.eval.harness import environment
from kvrelay.reuse import get_method
from kvrelay.reuse.move_pool import MovePool
from kvrelay.reuse.move_readout import MoveReadout


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def teach_keeping_rows(teach: Callable[[], object]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Run ``teach`` (learning calls of a ``relay_anchors`` with ``anchor_blend`` > 0) and return, per role frozen
    meanwhile, the rows its readout was fitted from: (features [P, F], moves [P, 2 L Hkv hd]), fp16. ``freeze``
    drops the pool's references to them; these keep them."""
    rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    freeze = MovePool.freeze

    def keep_rows(pool: MovePool, role: str) -> None:
        if not pool._roles[role].frozen:
            rows[role] = pool.rows(role)
        freeze(pool, role)

    MovePool.freeze = keep_rows
    try:
        teach()
    finally:
        MovePool.freeze = freeze
    return rows


def score_calls(lm, args, methods: dict, capture: tuple[int, ...]
                ) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """Each method's first-token KL against ``full`` and its span token-layers computed again, per scored call (the
    ``--problems`` from ``--offset``), by name."""
    kls: dict[str, list[float]] = {}
    recomputed: dict[str, list[int]] = {}

    def on_call(call, store) -> None:
        scored = scored_runs(lm, call, store, methods, capture)
        if scored is None:
            return
        _, full, outs, _ = scored
        for name, out in outs.items():
            kls.setdefault(name, []).append(kl_first_token(full.logits, out.first_logits))
            recomputed.setdefault(name, []).append(out.stats.num_recomputed_token_layers)

    downstream_calls(lm, args.workload, None, args.problems, capture, on_call, "scored", True, args.offset)
    return kls, recomputed


def main() -> None:
    ap = pool_parser(__doc__.splitlines()[0])
    ap.add_argument("--top-r", default="0.06", help="the band's shares of the span tokens, a comma list")
    ap.add_argument("--tops", default="", help="the band's top layers (l_end), a comma list (default: the last)")
    ap.add_argument("--starts", default="", help="the band's first layers (l_start = l_det; carried states enter "
                    "there), a comma list (default: the profile's L_start)")
    ap.add_argument("--blends", default="0.5,0.65,0.8", help="anchor_blend values, a comma list")
    ap.add_argument("--ridges", default="0.03,0.1,0.3", help="anchor_ridge values, a comma list")
    args, lm, start, capture = open_pool_study(ap)
    try:
        blends, ridges, shares = floats(args.blends), floats(args.ridges), floats(args.top_r)
        tops = [int(t) for t in args.tops.split(",") if t] or [lm.config.num_layers - 1]
        starts = [int(t) for t in args.starts.split(",") if t] or [start]
    except ValueError as exc:
        ap.error(f"--blends, --ridges, --top-r, --starts and --tops take comma lists of numbers ({exc})")
    if not all(0 < b <= 1 for b in blends) or not all(r > 0 for r in ridges) or not all(0 < r <= 1 for r in shares):
        ap.error("--blends and --top-r must be in (0, 1] and --ridges > 0")
    if not all(0 < first <= t < lm.config.num_layers for first in starts for t in tops):
        ap.error(f"--starts and --tops must be layers with 0 < start <= top < {lm.config.num_layers}")
    capture = tuple(sorted(set(capture) | set(starts)))  # every band's carried states
    bands = {(r, first, t): ANCHOR_BAND.format(start=first, top=t, r=r)
             for r in shares for first in starts for t in tops}
    band = ANCHOR_BAND.format(start=start, top=lm.config.num_layers - 1, r=shares[0])
    calls = f"anchor_calls={args.pool_problems}"
    teacher = get_method(f"relay_anchors[{calls},{band},anchor_blend=0.5]")
    rows = teach_keeping_rows(lambda: downstream_calls(
        lm, args.workload, None, args.pool_problems, capture,
        lambda call, store: Engine(lm, store, capture_layers=capture).generate(
            call, teacher, GenerateOptions(ONE.sampling, learn=True)),
        "pool", True, args.pool_offset))
    readouts = {}
    for lam in ridges:
        readouts[lam] = MoveReadout(lam)
        for role, (side, moves) in rows.items():
            readouts[lam].fit(role, side, moves)
    rows.clear()
    methods = {"relay": get_method("relay"), f"anchors + {shares[0]}": get_method(f"relay_anchors[{calls},{band}]")}
    for each_band in bands.values():
        for blend in blends:
            for lam in ridges:
                spec = f"relay_anchors[{calls},{each_band},anchor_blend={blend},anchor_ridge={lam}]"
                methods[spec] = get_method(spec)
                methods[spec].readout = readouts[lam]
    for name, method in methods.items():
        if name != "relay":
            method.pool = teacher.pool
    kls, recomputed = score_calls(lm, args, methods, capture)
    summary = {name: {"mean": statistics.mean(v), "median": statistics.median(v),
                      "below_relay": sum(a < b for a, b in zip(v, kls["relay"], strict=True)),
                      "recomputed_token_layers": statistics.mean(recomputed[name])}
               for name, v in kls.items()}
    Path(args.json).write_text(json.dumps({
        "model": lm.name, "workload": args.workload, "offset": args.offset, "problems": args.problems,
        "pool_offset": args.pool_offset, "pool_problems": args.pool_problems, "top_r": shares, "starts": starts,
        "tops": tops,
        "blends": blends, "ridges": ridges, "environment": environment("cpu"), "summary": summary, "calls": kls},
        indent=1) + "\n")
    for name, s in summary.items():
        print(f"{name:110s} KL {s['mean']:.5f} median {s['median']:.5f} below relay {s['below_relay']} "
              f"recomputed {s['recomputed_token_layers']:.0f}")


if __name__ == "__main__":
    main()
