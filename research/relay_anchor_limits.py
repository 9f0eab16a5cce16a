"""What limits naive plus anchors' first-token KL, and what the span tokens a call recomputes could add to it.

Naive plus anchors (``relay_anchors`` with the empty band) moves every loaded span token by its anchors' estimate and
computes none; its first-token KL is about twice the shipped relay's. On calibration (train) calls, with one pool
taught as ``relay_anchor_select.py``'s (``--pool-problems`` from ``--pool-offset``, frozen into its index), this
script asks, with the span K/V set by hand (``KVShift`` from a full prefill, as the oracle studies do):

- ``true K`` / ``true V``: every span token's true keys, or values, at every layer, the anchors' for the other;
- ``true layers A-B``: every span token's true K/V at layers A..B only, the anchors' elsewhere (which layers' error
  costs the first token most);
- ``a quarter of the residual``: every anchored K/V moved a quarter of the way to the true one;
- ``call mean xC``: the anchors plus C x the mean of the residual they leave over the call's span tokens, per
  layer, head and channel (the best a single shift per call could add: an oracle);
- ``top r true + band mean xC``: the top r of the span tokens by the expected residual get their true K/V at every
  layer (the best the band, which computes them from L_start, could give them), and the others the anchors plus C x
  those tokens' mean residual (what they could tell the rest within the call);

and, as the methods run (``--bands``, ``relay_anchors`` knobs after its band from the profile's L_start to the top):
ranking the band by the new tokens' attention (``selector=both``/``influence``) besides or instead of the expected
residual alone.

Usage: python research/relay_anchor_limits.py --problems 20 --offset 100 --pool-offset 120 --pool-problems 128 \\
    --json OUT.json [--pool-cache POOL.pt]
"""

from __future__ import annotations

import json
import pickle
import statistics
from pathlib import Path

import torch
from relay_anchor_select import ONE, open_pool_study, pool_parser, scored_runs, scores_of
from relay_oracle_shift import moved_logits

from kvrelay.engine import Engine, GenerateOptions
from kvrelay.eval.calibration_calls import downstream_calls
from kvrelay.eval.fidelity import kl_first_token
from kvrelay.eval.harness import environment
from kvrelay.reuse import get_method

BANDS = ("top_r=0.02,selector=priors,anchor_select=1;top_r=0.02,selector=both,anchor_select=1;"
         "top_r=0.02,selector=both,anchor_select=3;top_r=0.02,selector=influence;top_r=0.03,selector=both,anchor_select=1")


def layer_blocks(num_layers: int, size: int = 5) -> list[tuple[int, int]]:
    """Layers 1..L-1 in blocks of ``size`` (the last may be shorter): [(first, last), ...]."""
    return [(a, min(a + size - 1, num_layers - 1)) for a in range(1, num_layers, size)]


def top_mask(score: torch.Tensor, ratio: float) -> torch.Tensor:
    """[m] bool: the round(ratio x m) highest of ``score`` (at least one)."""
    chosen = torch.zeros(score.numel(), dtype=torch.bool, device=score.device)
    chosen[score.topk(max(1, round(ratio * score.numel()))).indices] = True
    return chosen


def variants(dk: torch.Tensor, dv: torch.Tensor, ak: torch.Tensor, av: torch.Tensor, residual: torch.Tensor,
             ratio: float) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The span K/V moves each hand-set variant gives, name -> (K, V) [L, Hkv, m, hd], from the true moves (dk, dv)
    and the anchors' (ak, av) and expected residual [m]."""
    rk, rv = dk - ak, dv - av
    out = {"anchors": (ak, av), "true K": (dk, av), "true V": (ak, dv),
           "a quarter of the residual": (ak + 0.25 * rk, av + 0.25 * rv)}
    for first, last in layer_blocks(dk.shape[0]):
        block = torch.zeros(dk.shape[0], 1, 1, 1, dtype=torch.bool, device=dk.device)
        block[first : last + 1] = True
        out[f"true layers {first}-{last}"] = (torch.where(block, dk, ak), torch.where(block, dv, av))
    mk, mv = rk.mean(2, keepdim=True), rv.mean(2, keepdim=True)  # [L, Hkv, 1, hd]
    for c in (0.5, 1.0):
        out[f"call mean x{c}"] = (ak + c * mk, av + c * mv)
    chosen = top_mask(residual, ratio)[:, None]  # [m, 1]: broadcast over hd
    bk, bv = rk[:, :, chosen[:, 0]].mean(2, keepdim=True), rv[:, :, chosen[:, 0]].mean(2, keepdim=True)
    for c in (0.0, 0.25, 0.5, 1.0):
        out[f"top {ratio} true + band mean x{c}"] = (torch.where(chosen, dk, ak + c * bk),
                                                     torch.where(chosen, dv, av + c * bv))
    return out


def shares(dk: torch.Tensor, dv: torch.Tensor, ak: torch.Tensor, av: torch.Tensor) -> dict[str, float]:
    """Share of the squared move (layers 1 up) the anchors explain, and of their residual the call's mean
    residual would."""
    rk, rv = (dk - ak)[1:], (dv - av)[1:]
    return {"K explained": 1 - float(rk.pow(2).sum() / dk[1:].pow(2).sum()),
            "V explained": 1 - float(rv.pow(2).sum() / dv[1:].pow(2).sum()),
            "K residual by the call mean": 1 - float((rk - rk.mean(2, keepdim=True)).pow(2).sum() / rk.pow(2).sum()),
            "V residual by the call mean": 1 - float((rv - rv.mean(2, keepdim=True)).pow(2).sum() / rv.pow(2).sum())}


def main() -> None:
    ap = pool_parser(__doc__.splitlines()[0])
    ap.add_argument("--ratio", type=float, default=0.02, help="the band's share for the band-mean variants")
    ap.add_argument("--bands", default=BANDS, help="relay_anchors band knobs run as methods, a ';' list")
    ap.add_argument("--pool-cache", help="a file holding the taught pool: read if it exists, else written (a pickle: "
                                         "only a file this script wrote)")
    args, lm, start, capture = open_pool_study(ap)
    top = lm.config.num_layers - 1
    calls = f"anchor_calls={args.pool_problems}"
    band = f"l_start={start},l_det={start},l_end={top},l_pre=0,l_suf=0"
    specs = ["relay", f"relay_anchors[{calls},l_start={top + 1},l_det={top + 1},l_end={top + 1}]",
             *(f"relay_anchors[{calls},{band},{knobs}]" for knobs in args.bands.split(";") if knobs)]
    methods = {spec: get_method(spec) for spec in specs}
    teacher = methods[specs[1]]
    teacher._pool(lm)

    def learn(call, store) -> None:
        Engine(lm, store, capture_layers=capture).generate(call, teacher, GenerateOptions(ONE.sampling, learn=True))

    taught_on = {"model": lm.name, "workload": args.workload, "pool_offset": args.pool_offset,
                 "pool_problems": args.pool_problems}
    if args.pool_cache and Path(args.pool_cache).exists():
        try:
            cached = torch.load(args.pool_cache, weights_only=False)
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
            ap.error(f"--pool-cache {args.pool_cache} cannot be read ({exc}): delete it to teach the pool again")
        if not isinstance(cached, dict) or cached.get("taught_on") != taught_on:
            ap.error(f"--pool-cache {args.pool_cache} holds no pool taught on "
                     f"{taught_on}: give another file")
        teacher.pool = cached["pool"]
    else:
        downstream_calls(lm, args.workload, None, args.pool_problems, capture, learn, "pool", True, args.pool_offset)
        if args.pool_cache:
            torch.save({"taught_on": taught_on, "pool": teacher.pool}, args.pool_cache)
    for spec in specs[2:]:
        methods[spec].pool = teacher.pool
    rows: dict[str, list[float]] = {}

    def on_call(call, store) -> None:
        scored = scored_runs(lm, call, store, methods, capture)
        if scored is None:
            return
        reuse, full, outs, (dk, dv) = scored  # dk, dv: [L, Hkv, m, hd]
        for spec, out in outs.items():
            rows.setdefault(f"runs: {spec}", []).append(kl_first_token(full.logits, out.first_logits))
        ak, av, residual, _ = scores_of(teacher, lm, call, store, reuse)
        for name, (mk, mv) in variants(dk, dv, ak, av, residual, args.ratio).items():
            logits = moved_logits(lm, call, store, reuse, mk, mv)
            rows.setdefault(name, []).append(kl_first_token(full.logits, logits))
        for name, value in shares(dk, dv, ak, av).items():
            rows.setdefault(f"share: {name}", []).append(value)

    downstream_calls(lm, args.workload, None, args.problems, capture, on_call, "scored", True, args.offset)
    anchors = rows["anchors"]
    summary = {name: {"mean": statistics.mean(v), "median": statistics.median(v),
                      "calls below the anchors": None if name.startswith("share") else
                      sum(x < a for x, a in zip(v, anchors, strict=True))} for name, v in rows.items()}
    Path(args.json).write_text(json.dumps({
        "model": lm.name, "workload": args.workload, "offset": args.offset, "problems": args.problems,
        "pool_offset": args.pool_offset, "pool_problems": args.pool_problems, "ratio": args.ratio,
        "bands": args.bands, "pool_cache": args.pool_cache,
        "environment": environment("cpu"), "summary": summary, "calls": rows}, indent=1) + "\n")
    for name, s in summary.items():
        below = "" if s["calls below the anchors"] is None else f"  below the anchors {s['calls below the anchors']}"
        print(f"{name:110s} mean {s['mean']:.5f}  median {s['median']:.5f}{below}")


if __name__ == "__main__":
    main()
