"""Which span tokens relay should recompute on top of the anchors: the ones whose move the anchors expect to miss.

Naive plus anchors (``relay_anchors`` with the empty band) computes no span token and halves relay's reach to the ideal
speedup, but leaves a first-token KL about twice the shipped relay's. This script asks which few span tokens are worth
recomputing on top of the anchors, on calibration (train) calls. One ``relay_anchors`` pool learns, through the
method's own learning calls, on ``--pool-problems`` problems from ``--pool-offset`` (as many dense calls per role as
``anchor_calls`` asks: the pool is then frozen into its index); every method below shares it. On each scored call
(``--offset``, ``--problems``; none of them a pool problem):

- ``exact top r by <score>``: the anchored span K/V, but the top share r of the span tokens by a score get their true
  K/V at every layer (``KVShift`` from a full prefill, as ``relay_anchor_shift.py``'s oracle): what recomputing them
  would give at best. Scores: ``expected residual`` (``MovePool.estimate_with_residual``: the spread of the mixed
  rows' tokens about the estimate, what ``anchor_select`` ranks by), ``expected move`` (that spread about zero),
  ``true move`` and ``true residual`` (oracles: the token's own move, and what the anchors leave of it);
- the methods as they run: ``relay`` (shipped), naive plus anchors, and ``relay_anchors`` recomputing the top r by
  the expected residual through relay's band from layer 2 to the top (``ANCHOR_BAND``), for r in ``--ratios``.

First-token KL against ``full`` on the same prompt ids, mean over calls; reuse and TTFT (median, this process) for the
methods.

Usage: python research/relay_anchor_select.py --problems 20 --offset 100 --pool-offset 120 --pool-problems 128 \\
    --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from relay_oracle_shift import moved_logits, moves, span_call
from relay_train_points import calls_parser

from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine, GenerateOptions
from kvrelay.eval.calibration_calls import downstream_calls
from kvrelay.eval.fidelity import kl_first_token
from kvrelay.eval.harness import environment
from kvrelay.model.lm import LoadedModel
from kvrelay.model.sampling import SamplingConfig
from kvrelay.reuse import get_method
from kvrelay.reuse.base import CallInput
from kvrelay.reuse.relay_anchors import RelayAnchorsMethod, stored_keys_free
from kvrelay.reuse.spans import ReusePlan
from kvrelay.weights.loader import load_model

# relay's band from its profile's L_start (where the carried states enter; 2 on SmolLM2) to the top, admitting the top_r
# span tokens by the anchors' expected residual alone
ANCHOR_BAND = "l_start={start},l_det={start},l_end={top},top_r={r},l_pre=0,l_suf=0,selector=priors,anchor_select=1"
ONE = GenerateOptions(SamplingConfig(max_new_tokens=1), learn=False)


def scores_of(method: RelayAnchorsMethod, lm: LoadedModel, call: CallInput, store: KVStore, reuse: ReusePlan
              ) -> tuple[torch.Tensor, ...]:
    """The anchors' (K, V) moves [L, Hkv, m, hd] and per-token expected residual and expected move [m], over the
    call's approximate span tokens in ``reuse.approx_idx()`` order."""
    pool, parts = method.pool, []
    for load, role in zip(reuse.approx, method.roles(call, reuse.approx), strict=True):
        keys_free = stored_keys_free(lm.model.rope, store.get(load.span_id), load, pool.device, pool.match_layer)
        k_move, v_move, residual = pool.estimate_with_residual(role, keys_free, lm.config.num_layers)
        both = torch.cat([k_move, v_move])  # [2L, Hkv, n, hd]
        expected = residual + torch.linalg.vector_norm(both, dim=(0, 1, 3)).square()  # [n]
        parts.append((k_move, v_move, residual, expected))
    ak, av = (torch.cat([p[j] for p in parts], 2) for j in range(2))
    ak[0], av[0] = 0, 0  # layer 0's K/V depend on token and position only
    return ak, av, torch.cat([p[2] for p in parts]), torch.cat([p[3] for p in parts])


def run_methods(lm: LoadedModel, call: CallInput, store: KVStore, methods: dict, capture: tuple[int, ...]) -> dict:
    """spec -> each method's one-token run of ``call`` on one engine; a method that fell back stops the study (a role
    the pool problems did not all teach)."""
    engine, outs = Engine(lm, store, methods.values(), capture_layers=capture), {}
    for spec, method in methods.items():
        outs[spec] = engine.generate(call, method, ONE)
        if outs[spec].stats.fallback:
            raise SystemExit(f"{spec}: {outs[spec].stats.fallback} (a role the pool problems did not all teach)")
    return outs


def scored_runs(lm: LoadedModel, call: CallInput, store: KVStore, methods: dict, capture: tuple[int, ...]):
    """A scored call's reuse plan, ``full``'s result, ``run_methods``' outputs and the span tokens' true moves (K, V)
    [L, Hkv, m, hd]; None where the call relays no span token."""
    scored = span_call(lm, call, store)
    if scored is None:
        return None
    reuse, full, fresh = scored
    return reuse, full, run_methods(lm, call, store, methods, capture), moves(lm, call, store, reuse, fresh)


def pool_parser(description: str) -> argparse.ArgumentParser:
    """The flags of a study that teaches one anchors' pool on calibration (train) problems and scores others."""
    ap = calls_parser(description, problems=20, path_tokens=False)
    ap.add_argument("--pool-offset", type=int, default=120)
    ap.add_argument("--pool-problems", type=int, default=128)
    return ap


def open_pool_study(ap: argparse.ArgumentParser) -> tuple[argparse.Namespace, LoadedModel, int, tuple[int, ...]]:
    """Parse ``pool_parser``'s flags (the pool problems must not overlap the scored ones), set the threads and load
    the model: (the flags, the model, the profile's L_start, the layers whose hidden states the band needs carried)."""
    args = ap.parse_args()
    if args.pool_offset < args.offset + args.problems and args.offset < args.pool_offset + args.pool_problems:
        ap.error("the pool problems and the scored problems overlap: move --pool-offset")
    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    start = get_method("relay").layers(lm)[0]  # the profile's L_start: the carried states the band needs
    return args, lm, start, (start,) if start else ()


def main() -> None:
    ap = pool_parser(__doc__.splitlines()[0])
    ap.add_argument("--ratios", default="0.02,0.03,0.05", help="shares of the span tokens recomputed, a comma list")
    args, lm, start, capture = open_pool_study(ap)
    top, ratios = lm.config.num_layers - 1, [float(r) for r in args.ratios.split(",")]
    calls = f"anchor_calls={args.pool_problems}"  # the pool problems teach every role its learning calls, no more
    specs = ["relay", f"relay_anchors[{calls},l_start={top + 1},l_det={top + 1},l_end={top + 1}]",
             *(f"relay_anchors[{calls},{ANCHOR_BAND.format(start=start, top=top, r=r)}]" for r in ratios)]
    methods = {spec: get_method(spec) for spec in specs}
    teacher = methods[specs[1]]
    for spec in specs[2:]:
        methods[spec].pool = teacher._pool(lm)  # one pool, the same anchor knobs: every method reads it

    def learn(call, store) -> None:
        Engine(lm, store, capture_layers=capture).generate(call, teacher, GenerateOptions(ONE.sampling, learn=True))

    downstream_calls(lm, args.workload, None, args.pool_problems, capture, learn, "pool", True, args.pool_offset)
    rows: dict[str, list[dict]] = {}

    def on_call(call, store) -> None:
        scored = scored_runs(lm, call, store, methods, capture)
        if scored is None:
            return
        reuse, full, outs, (dk, dv) = scored  # dk, dv: [L, Hkv, m, hd]
        for spec, out in outs.items():
            stats = out.stats
            rows.setdefault(spec, []).append({"kl": kl_first_token(full.logits, out.first_logits),
                                              "reuse": stats.num_reused_token_layers / stats.num_prompt_token_layers,
                                              "ttft_ms": stats.ttft_ms})
        span_idx = reuse.approx_idx()
        ak, av, residual, expected = scores_of(teacher, lm, call, store, reuse)
        true_move = dk[1:].pow(2).sum((0, 1, 3)) + dv[1:].pow(2).sum((0, 1, 3))
        true_residual = (dk - ak)[1:].pow(2).sum((0, 1, 3)) + (dv - av)[1:].pow(2).sum((0, 1, 3))
        scores = {"expected residual": residual, "expected move": expected, "true move": true_move,
                  "true residual": true_residual}
        for ratio in [0.0, *ratios]:
            for name, score in scores.items():
                if ratio == 0 and name != "expected residual":
                    continue
                chosen = torch.zeros(span_idx.numel(), dtype=torch.bool, device=score.device)
                chosen[score.topk(round(ratio * span_idx.numel())).indices] = True
                mk, mv = torch.where(chosen[:, None], dk, ak), torch.where(chosen[:, None], dv, av)
                logits = moved_logits(lm, call, store, reuse, mk, mv)
                key = "anchors alone" if ratio == 0 else f"exact top {ratio} by {name}"
                rows.setdefault(key, []).append({"kl": kl_first_token(full.logits, logits)})

    downstream_calls(lm, args.workload, None, args.problems, capture, on_call, "scored", True, args.offset)
    summary = {name: {k: (statistics.median if k == "ttft_ms" else statistics.mean)(r[k] for r in rs)
                      for k in rs[0]} for name, rs in rows.items()}
    Path(args.json).write_text(json.dumps({
        "model": lm.name, "workload": args.workload, "offset": args.offset, "problems": args.problems,
        "pool_offset": args.pool_offset, "pool_problems": args.pool_problems, "ratios": ratios,
        "index_rows": {r: teacher.pool.num_entries(r) for r in sorted(teacher.pool._roles)},
        "environment": environment("cpu"), "summary": summary, "calls": rows}, indent=1) + "\n")
    for name, s in summary.items():
        print(f"{name:100s} " + "  ".join(f"{k} {v:.5f}" if k == "kl" else f"{k} {v:.3f}" for k, v in s.items()))


if __name__ == "__main__":
    main()
