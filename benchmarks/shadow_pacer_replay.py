"""Which calls of a paced tenant the shadow pacer shadows, by prompt length: recorded call streams replayed through
``ShadowPacer`` offline (no server, no model), its rule (each call drawn at the rate learned to spend the share)
against two that decide on a credit: the first call after the credit, less what the call's own prefill earned,
turns positive; and the credit asked to cover each call's own reference.

Each stream is a ``quality_shadow_load.py --salt chain`` run's per-call rows (a fresh ``cache_salt`` per chain:
every call its role's first, so the guard wants every call shadowed and the pacer alone decides). A call's live
engine time is its recorded prefill (engine TTFT less its queue wait) and decode (first token to end: one client,
so the engine had the call to itself); its reference's cost is ``kvrelay.server.shadow.reference_ms``, the server's
own prediction, over a chunk budget whose coefficients are fitted to the stream's calls that reused nothing (a
whole prefill each). A reference takes its predicted time, and every call is paced (no warm-up). The rows of the
guard-off phases are replayed (their live times carry no shadow work), each phase from a fresh pacer (the server's
rule with its default seed). Beside them,
labelled: ``resampled``, 2000 of a file's recorded chains drawn with replacement in a seeded order (a long run of
the same mix), and ``synthetic``, lengths drawn from the recorded ones with every call's live time the streams'
mean (the rule alone, without a long prompt's own longer prefill earning the credit it is shadowed on).

    python benchmarks/shadow_pacer_replay.py --json benchmarks/results/shadow-pacer-replay.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

from shadow_load_stats import call_live_ms, fit_prefill_coef, replay_pacer, shadowed_by_quartile

from kvrelay.eval.result_files import read_json
from kvrelay.server.chunk_budget import ChunkBudget
from kvrelay.server.scheduler import DEFAULT_PREFILL_CHUNK_TOKENS
from kvrelay.server.shadow import reference_ms
from kvrelay.server.shadow_pacer import ShadowPacer

RESULTS = Path(__file__).resolve().parent / "results"
STREAMS = ("quality-shadow-salted-long-cpu", "quality-shadow-salted-cpu")
NUM_RESAMPLED_CHAINS = 2000
NUM_SYNTHETIC_CALLS = 6000
PAUSE_S = 1.5  # between resampled chains, as the recorded runs paused


class OwnCostPacer(ShadowPacer):
    """A comparison: a paced call is shadowed only when the credit covers its own reference's predicted time, and
    the credit may grow to the last refused reference's time (so a reference dearer than the window can be paid)."""

    def __init__(self, share: float, clock) -> None:
        super().__init__(share, clock)
        self.asked_ms = 0.0

    @property
    def cap_ms(self) -> float:
        return max(self.share * 60e3, self.asked_ms)

    def covers(self, cost_ms: float) -> bool:
        if self.credit_ms >= cost_ms:
            return True
        self.asked_ms = cost_ms
        return False


class PositiveCreditPacer(ShadowPacer):
    """A comparison: a paced call is shadowed when the credit, less what its own prefill earned, is positive (the
    first call after the credit turns positive: drawn in proportion to the live time before it)."""

    def positive(self, prefill_ms: float) -> bool:
        return self.credit_ms - self.share * prefill_ms > 0


# the server's rule (each call drawn at the learned rate); the first call on a positive credit; the credit asked to
# cover the call's own cost
RULES = {"bernoulli": (ShadowPacer, lambda pacer, cost, prefill_ms: pacer.affordable(cost)),
         "positive_credit": (PositiveCreditPacer, lambda pacer, cost, prefill_ms: pacer.positive(prefill_ms)),
         "own_cost": (OwnCostPacer, lambda pacer, cost, prefill_ms: pacer.covers(cost))}


def replay(calls: list[dict], share: float, cost_ms, edges: list[float]) -> dict:
    """Each rule over one stream (each from a fresh pacer): shadowed calls per length quartile and the share."""
    ordered = sorted(calls, key=lambda c: c["sent_s"])
    out = {"num_calls": len(ordered)}
    for name, (cls, affordable) in RULES.items():
        result = replay_pacer(ordered, cls(share, clock=lambda: 0.0), cost_ms, affordable)
        out[name] = {"num_shadowed": result["num_shadowed"],
                     "shadow_share_of_live": round(result["shadow_share_of_live"], 4),
                     **shadowed_by_quartile([c["prompt_tokens"] for c in ordered], result["taken"], edges)}
    return out


def resampled(calls: list[dict], rng: random.Random) -> list[dict]:
    """``NUM_RESAMPLED_CHAINS`` recorded chains drawn with replacement, one after another (``PAUSE_S`` between)."""
    chains: dict[tuple, list[dict]] = {}
    for c in calls:
        chains.setdefault((c["repeat"], c["chain"]), []).append(c)
    keys, out, t_s = sorted(chains), [], 0.0
    for _ in range(NUM_RESAMPLED_CHAINS):
        chain = sorted(chains[rng.choice(keys)], key=lambda c: c["sent_s"])
        for c in chain:
            out.append({**c, "sent_s": t_s + c["sent_s"] - chain[0]["sent_s"]})
        t_s = out[-1]["sent_s"] + out[-1]["total_ms"] / 1e3 + PAUSE_S
    return out


def synthetic(calls: list[dict], rng: random.Random) -> list[dict]:
    """``NUM_SYNTHETIC_CALLS`` prompt lengths drawn from the recorded ones, each call's live time the mean (a third
    prefill, the rest decode), independent of its length."""
    mean_ms = statistics.mean(sum(call_live_ms(c)) for c in calls)
    return [{"prompt_tokens": rng.choice(calls)["prompt_tokens"], "sent_s": float(k), "engine_ttft_ms": mean_ms / 3,
             "queue_ms": 0.0, "ttft_ms": 0.0, "total_ms": 2 * mean_ms / 3} for k in range(NUM_SYNTHETIC_CALLS)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", nargs="+", default=list(STREAMS), help="recorded runs under benchmarks/results")
    p.add_argument("--share", type=float, default=0.05, help="the server's --quality-shadow-share")
    p.add_argument("--chunk-tokens", type=int, default=DEFAULT_PREFILL_CHUNK_TOKENS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    report = {"command": " ".join(["python", *sys.argv]), "share": args.share, "chunk_tokens": args.chunk_tokens,
              "seed": args.seed, "streams": {}}
    for name in args.streams:
        calls = [c for c in read_json(RESULTS / f"{name}.calls.json")["calls"] if c["arm"] == "off"]
        budget = ChunkBudget(args.chunk_tokens)
        budget.coef_ms = fit_prefill_coef(calls, args.chunk_tokens)

        def cost_ms(call: dict, budget: ChunkBudget = budget) -> float:
            return reference_ms(call["prompt_tokens"], budget)

        lengths = sorted(c["prompt_tokens"] for c in calls)
        edges = shadowed_by_quartile(lengths, [False] * len(lengths))["edges_tokens"]
        rng = random.Random(args.seed)
        entry = {"coef_ms": budget.coef_ms, "num_tokens_min_max": [lengths[0], lengths[-1]],
                 "reference_ms_at": {n: round(reference_ms(n, budget)) for n in (lengths[0], int(edges[1]),
                                                                                   lengths[-1])},
                 "recorded": {f"off{r}": replay([c for c in calls if c["repeat"] == r], args.share, cost_ms, edges)
                              for r in sorted({c["repeat"] for c in calls})},
                 "resampled": replay(resampled(calls, rng), args.share, cost_ms, edges),
                 "synthetic": replay(synthetic(calls, rng), args.share, cost_ms, edges)}
        report["streams"][name] = entry
        for part in ("recorded", "resampled", "synthetic"):
            runs = entry[part].items() if part == "recorded" else [(part, entry[part])]
            for label, run in runs:
                print(name, label, {rule: ([f"{q['num_shadowed']}/{q['num_calls']}" for q in run[rule]["quartiles"]],
                                           run[rule]["shadow_share_of_live"]) for rule in RULES}, flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
