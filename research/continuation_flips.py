"""Where along full's greedy continuation a reuse method's top-1 first differs, per call, on calibration calls.

Each downstream call is held to ``full``'s first ``--path-tokens`` greedy tokens, teacher-forced, as ``kvrelay
profile`` scores its candidates (``kvrelay.eval.path_fidelity``); per method and call this records the positions
whose top-1 differs from full's token, the KL(full || m) at each position, full's top-1 margin (probability of
its first token minus its second's) and which upstream outputs the call reads. The summary: greedy@N per reader
(``critic``: reads the solver; ``finalizer``: the solver and the critic), where the first flip falls, and the mean
KL at the first two positions. For finding which part of a continuation a method's errors flip.

Usage: python research/continuation_flips.py --model gemma3-270m --workload gsm8k-chain3 --offset 100
    --problems 20 [--points POINTS.json] --json OUT.json
POINTS.json: as ``relay_train_points.py``'s (relay points scored beside epic and cacheblend); without it, the
profile's relay.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch
from relay_train_points import load_points

from kvrelay.engine import Engine
from kvrelay.eval.calibration_calls import downstream_calls
from kvrelay.eval.fidelity import kl_first_token
from kvrelay.eval.harness import environment
from kvrelay.eval.path_fidelity import forced_logits, path_reference
from kvrelay.eval.report import NEAR_TIE_MARGIN
from kvrelay.eval.result_files import read_json
from kvrelay.reuse.cacheblend import CacheBlendMethod
from kvrelay.reuse.epic import EpicMethod
from kvrelay.reuse.relay import RelayMethod
from kvrelay.weights.loader import load_model

# full's top-1 margin up to which a flip counts as close (not a near tie by the bench's line, but small)
CLOSE_MARGIN = 0.05


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--workload", default="gsm8k-chain3")
    ap.add_argument("--offset", type=int, default=100, help="skip this many problems (GSM8K: of train)")
    ap.add_argument("--data", help="problems file (default: GSM8K train for GSM8K workloads, else the workload's "
                    "own); a test file is for diagnosing a held-out gap, never for choosing")
    ap.add_argument("--problems", type=int, default=20)
    ap.add_argument("--path-tokens", type=int, default=32)
    ap.add_argument("--points", help="JSON file: name -> relay knobs (default: the profile's relay)")
    ap.add_argument("--json", help="where to write the per-call records")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--summarize", nargs="+", metavar="RECORDS", help="only summarize these runs' records "
                    "(their calls pooled): KL by position, and the calls only one method flips by full's margin")
    args = ap.parse_args()
    if args.summarize:
        calls = [c for path in args.summarize for c in read_json(path)["calls"]]
        summarize(calls)
        for name in calls[0]["methods"]:
            print(f"{name:40s} KL by position: " + " ".join(
                f"{lo}-{hi}: {position_kl(calls, name, lo, hi):.4f}" for lo, hi in ((0, 0), (1, 1), (2, 7), (8, 31))))
        for a, b in (("relay", "epic"), ("epic", "relay")):
            discordant(calls, a, b)
        return
    if not args.json:
        ap.error("--json is required unless --summarize is given")
    torch.set_num_threads(args.threads)
    points, relays = load_points(args.points) if args.points else (None, {"relay": RelayMethod()})
    if "cacheblend" in relays:
        raise SystemExit(f"{args.points}: 'cacheblend' is a baseline's name; name the relay point otherwise")
    methods = {"epic": EpicMethod(), "cacheblend": CacheBlendMethod(), **relays}
    lm = load_model(args.model)
    calls = []

    def on_call(call, store) -> None:
        engine = Engine(lm, store)
        ref = path_reference(engine, call, args.path_tokens)
        top2 = torch.softmax(ref.logits, -1).topk(2, -1).values  # [positions, 2]
        record = {"reads": sorted({r.name for r in call.refs if r.kind == "output"}), "fed_ids": ref.fed_ids,
                  "full_margin": (top2[:, 0] - top2[:, 1]).tolist(), "methods": {}}
        for name, method in methods.items():
            logits, stats = forced_logits(engine, call, method, ref.fed_ids)
            logits = logits[:ref.num_positions]
            top_ids = logits.argmax(-1).tolist()
            record["methods"][name] = {
                "reuse": stats.reuse_rate,
                "kl": [kl_first_token(ref.logits[i], logits[i]) for i in range(ref.num_positions)],
                "flips": flips(top_ids, ref)}
        calls.append(record)

    capture = tuple(sorted({layer for m in methods.values() for layer in m.capture_layers(lm)}))
    downstream_calls(lm, args.workload, args.data, args.problems, capture, on_call, "calls", True, args.offset)
    Path(args.json).write_text(json.dumps({
        "model": lm.name, "workload": args.workload, "data": args.data, "offset": args.offset,
        "problems": args.problems, "path_tokens": args.path_tokens, "points": points,
        "environment": environment("cpu"), "calls": calls}) + "\n")
    summarize(calls)


def flips(top_ids: list[int], ref) -> list[int]:
    """Positions whose top-1 differs from full's token; with a stopped continuation, its stop row too when the
    method's top-1 there is no stop id (as ``path_fidelity.score_path`` holds it)."""
    out = [i for i, (a, b) in enumerate(zip(top_ids, ref.fed_ids, strict=False)) if a != b]
    stop_row = len(ref.fed_ids)
    if ref.num_positions > stop_row and top_ids[stop_row] not in ref.stop_ids:
        out.append(stop_row)
    return out


def summarize(calls: list[dict]) -> None:
    readers = sorted({"+".join(c["reads"]) for c in calls})
    for name in calls[0]["methods"]:
        rows = [c["methods"][name] for c in calls]
        greedy = {r: sum(not c["methods"][name]["flips"] for c in calls if "+".join(c["reads"]) == r)
                  for r in readers}
        counts = {r: sum("+".join(c["reads"]) == r for c in calls) for r in readers}
        first = Counter(r["flips"][0] for r in rows if r["flips"])
        kl = [position_kl(calls, name, i, i) for i in (0, 1)]
        print(f"{name:40s} reuse {sum(r['reuse'] for r in rows) / len(rows):.3f} greedy "
              + " ".join(f"{r}:{greedy[r]}/{counts[r]}" for r in readers)
              + f" first flips {dict(sorted(first.items()))} KL@0 {kl[0]:.4f} KL@1 {kl[1]:.4f}")


def discordant(calls: list[dict], a: str, b: str) -> None:
    """The calls whose continuation ``a`` flips and ``b`` keeps: where the first flip falls, and full's top-1
    margin there: a near tie (below ``NEAR_TIE_MARGIN``, the bench's line), up to ``CLOSE_MARGIN``, or above."""
    if any(m not in calls[0]["methods"] for m in (a, b)):
        return
    firsts = [(c["methods"][a]["flips"][0], c) for c in calls
              if c["methods"][a]["flips"] and not c["methods"][b]["flips"]]
    margins = [c["full_margin"][i] for i, c in firsts if i < len(c["full_margin"])]
    near = sum(m < NEAR_TIE_MARGIN for m in margins)
    close = sum(NEAR_TIE_MARGIN <= m <= CLOSE_MARGIN for m in margins)
    above = sorted(m for m in margins if m > CLOSE_MARGIN)
    print(f"only {a} flips: {len(firsts)} calls; first flip at positions {sorted(i for i, _ in firsts)}; "
          f"full's margin there < {NEAR_TIE_MARGIN}: {near}, {NEAR_TIE_MARGIN}-{CLOSE_MARGIN}: {close}, above: "
          f"{len(above)} ({', '.join(f'{m:.3f}' for m in above)})")


def position_kl(calls: list[dict], method: str, first: int, last: int) -> float:
    """Mean KL(full || method) over every (call, position) with first <= position <= last."""
    values = [kl for c in calls for i, kl in enumerate(c["methods"][method]["kl"]) if first <= i <= last]
    return sum(values) / max(1, len(values))


if __name__ == "__main__":
    main()
