"""``kvrelay bench --workload gsm8k-branches``: RKSC against ``full`` and ``prefix``, problem by problem.

Every method runs every problem (interleaved, batch size 1, greedy). Reported per method: median
wall time per problem and its split into branches and verification, speedups (median of
per-problem ratios), prompt tokens computed, the branch caches' K/V memory, pick accuracy. For
each rksc variant, the CGEE error two ways, never mixed: per problem (the pick differs from the
same run's pick without early exit: every branch verified at full depth) and per verification
call (the yes/no verdict of an exited call differs from full depth's). RSBCM vs LRU: the rksc
run's block-cache trace replayed under smaller budgets.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from tqdm import tqdm

from kvrelay.branches.blocks import POLICIES, interleave, replay
from kvrelay.branches.prompts import BranchConfig
from kvrelay.branches.runner import BranchRunner
from kvrelay.data import scoring
from kvrelay.data.datasets import load_gsm8k
from kvrelay.eval.configs import REFERENCES, BranchBenchConfig
from kvrelay.eval.harness import environment
from kvrelay.eval.stats import mean, median, median_ratio
from kvrelay.reuse import get_method
from kvrelay.weights.loader import load_model


def run_branch_bench(cfg: BranchBenchConfig, lm=None, progress: bool = True,
                     checkpoint: Callable[[dict], None] | None = None) -> dict:
    """Run the bench; ``checkpoint`` receives the result so far after every problem (a long run that is
    stopped keeps what it finished)."""
    lm = lm or load_model(cfg.model, device=cfg.device)
    bcfg = BranchConfig(cfg.branches, cfg.branch_tokens)
    runners = {m: BranchRunner(lm, bcfg, get_method(m) if m not in REFERENCES else None) for m in cfg.methods}
    problems = load_gsm8k(cfg.data, limit=cfg.offset + cfg.limit)[cfg.offset:]
    env = environment(cfg.device)  # taken once, at start: the commit whose code this run loaded
    records = []
    segments: dict[str, list[tuple[int, int]]] = {m: [] for m in runners}  # per problem: its block events
    for i, p in enumerate(tqdm(problems, desc="gsm8k-branches", unit="problem", disable=not progress,
                               file=sys.stderr)):
        row = {"problem_id": f"gsm8k-{cfg.offset + i}", "answer": p.answer, "runs": {}}
        for m, runner in runners.items():
            start = len(runner.blocks.events)
            run = runner.run(p.question, "rksc" if m not in REFERENCES else m)
            segments[m].append((start, len(runner.blocks.events)))
            d = run.to_dict()
            d["texts"] = [lm.tokenizer.decode(ids) for ids in run.output_ids]
            d["correct"] = scoring.gsm8k_correct(d["texts"][run.pick], p.answer)
            row["runs"][m] = d
        records.append(row)
        if checkpoint is not None and i + 1 < len(problems):
            checkpoint(_result(cfg, lm, runners, records, env, segments))
    return _result(cfg, lm, runners, records, env, segments)


def replay_table(events: list[tuple], segments: list[tuple[int, int]], budgets_mb: tuple[float, ...],
                 concurrency: tuple[int, ...], block_len: int, half_lives_ops: tuple[float, ...] = ()) -> list[dict]:
    """The trace replayed under each budget x policy x concurrency (``blocks.interleave``); RSBCM also
    with each importance half-life in ``half_lives_ops``."""
    per_problem = [events[a:b] for a, b in segments]
    variants = [(policy, 0.0) for policy in POLICIES] + [("rsbcm", h) for h in half_lives_ops]
    rows = []
    for c in concurrency:
        trace = interleave(per_problem, c) if c > 1 else events
        for budget in budgets_mb:
            for policy, half_life in variants:
                stats = replay(trace, int(budget * 2**20), policy, block_len, half_life)
                rows.append({"budget_mb": budget, "policy": policy, "half_life_ops": half_life, "concurrency": c,
                             **stats.to_dict()})
    return rows


def _result(cfg: BranchBenchConfig, lm, runners: dict, records: list[dict], env: dict,
            segments: dict[str, list[tuple[int, int]]]) -> dict:
    blocks = {}
    for m, runner in runners.items():
        if m in REFERENCES:
            continue
        live = runner.blocks
        blocks[m] = {"live": {"policy": live.policy, "budget_mb": live.budget_bytes / 2**20, **live.stats.to_dict()},
                     "working_set_bytes": _working_set(live.events),
                     "replay": replay_table(live.events, segments[m], cfg.compare_budgets_mb,
                                            cfg.compare_concurrency, live.block_len)}
    return {"env": env, "model": lm.name, "workload": "gsm8k-branches", "n": len(records),
            "config": dict(cfg.__dict__), "results": summarize_branches(records, cfg.methods),
            "blocks": blocks, "problems": records}


def _working_set(events: list[tuple]) -> dict:
    """Distinct block bytes inserted over the run and per problem (between root pins)."""
    seen: dict[bytes, int] = {}
    for event in events:
        if event[0] == "insert":
            for key, size in zip(event[1], event[2], strict=True):
                seen[key] = size
    return {"total_bytes": sum(seen.values()), "num_blocks": len(seen)}


def summarize_branches(records: list[dict], methods: tuple[str, ...]) -> dict:
    """Per method summary over problems (pure Python; also used to merge lanes)."""
    out = {}
    for m in methods:
        runs = [r["runs"][m] for r in records]
        full = [r["runs"]["full"] for r in records]
        prefix = [r["runs"]["prefix"] for r in records]
        s = {
            "total_ms_median": median([x["total_ms"] for x in runs]),
            "branch_ms_median": median([x["branch_ms"] for x in runs]),
            "verify_ms_median": median([x["verify_ms"] for x in runs]),
            "speedup_vs_full": median_ratio([x["total_ms"] for x in full], [x["total_ms"] for x in runs]),
            "speedup_vs_prefix": median_ratio([x["total_ms"] for x in prefix], [x["total_ms"] for x in runs]),
            "computed_token_share": sum(x["num_computed_tokens"] for x in runs)
            / sum(x["num_prompt_tokens"] for x in full),
            "branch_kv_mb_mean": mean([x["branch_kv_bytes"] for x in runs]) / 2**20,
            "kv_over_root_plus_own": mean([x["branch_kv_bytes"] / x["root_plus_own_bytes"] for x in runs]),
            "accuracy": mean([float(x["correct"]) for x in runs]),
            "pick_agrees_with_full": mean([float(x["pick"] == f["pick"]) for x, f in zip(runs, full, strict=True)]),
            "branches_equal_full": mean([float(a == b) for x, f in zip(runs, full, strict=True)
                                         for a, b in zip(x["output_ids"], f["output_ids"], strict=True)]),
            "n_problems": len(runs),
        }
        if runs and runs[0].get("ref_scores") is not None:
            s.update(_cgee_errors(runs))
        out[m] = s
    return out


def _cgee_errors(runs: list[dict]) -> dict:
    """Early-exit errors against the untimed full-depth reference."""
    calls = flips = exits = 0
    for x in runs:
        if x["scores"] is None:
            continue
        for score, ref, layer in zip(x["scores"], x["ref_scores"], x["exit_layers"], strict=True):
            calls += 1
            exits += layer is not None
            flips += (score >= 0.5) != (ref >= 0.5)
    skipped = sum(x["scores"] is None for x in runs)
    exit_layers = [la for x in runs for la in x["exit_layers"] if la is not None]
    return {
        "pick_agrees_without_early_exit": mean([float(x["pick"] == x["ref_pick"]) for x in runs]),
        "verifier_skipped_share": skipped / len(runs),
        "pick_agrees_when_skipped": mean([float(x["pick"] == x["ref_pick"]) for x in runs if x["scores"] is None])
        if skipped else None,
        "pick_agrees_when_verified": mean([float(x["pick"] == x["ref_pick"]) for x in runs if x["scores"] is not None])
        if skipped < len(runs) else None,
        "verify_calls": calls,
        "layer_exits": exits,
        "exit_layer_median": median(exit_layers) if exit_layers else None,
        "cgee_call_error": flips / calls if calls else None,
    }


def format_branch_table(result: dict) -> str:
    head = (f"{'method':28s} {'total ms':>9s} {'branch':>8s} {'verify':>8s} {'vs full':>8s} {'vs prefix':>9s} "
            f"{'computed':>8s} {'KV MB':>6s} {'KV/bound':>8s} {'acc':>5s} {'pick=ref':>8s} {'skip':>5s} "
            f"{'exits':>9s} {'call err':>8s}")
    lines = [head, "-" * len(head)]
    def opt(s: dict, key: str, fmt: str) -> str:
        return format(s[key], fmt) if s.get(key) is not None else "-"

    for m, s in result["results"].items():
        exits = f"{s['layer_exits']}/{s['verify_calls']}" if "layer_exits" in s else "-"
        lines.append(
            f"{m:28s} {s['total_ms_median']:9.0f} {s['branch_ms_median']:8.0f} {s['verify_ms_median']:8.0f} "
            f"{s['speedup_vs_full']:7.2f}x {s['speedup_vs_prefix']:8.2f}x {s['computed_token_share']:8.2f} "
            f"{s['branch_kv_mb_mean']:6.1f} {s['kv_over_root_plus_own']:8.2f} {s['accuracy']:5.2f} "
            f"{opt(s, 'pick_agrees_without_early_exit', '8.2f')} {opt(s, 'verifier_skipped_share', '5.2f')} "
            f"{exits:>9s} "
            f"{opt(s, 'cgee_call_error', '8.3f')}")
    for m, b in result.get("blocks", {}).items():
        live, working_mb = b["live"], b["working_set_bytes"]["total_bytes"] / 2**20
        lines.append(f"\n{m} block cache: live {live['policy']} at {live['budget_mb']:.0f} MiB, hit rate "
                     f"{live['hit_rate']:.3f}; {working_mb:.0f} MiB of distinct blocks over the run")
        lines.append(f"{'in flight':>9s} {'budget MiB':>10s} {'policy':>6s} {'hit rate':>9s} {'recomputed tok':>15s} "
                     f"{'evicted':>8s} {'rejected':>8s}")
        for r in b["replay"]:
            lines.append(f"{r.get('concurrency', 1):9d} {r['budget_mb']:10.0f} {r['policy']:>6s} {r['hit_rate']:9.3f} "
                         f"{r['num_recomputed_tokens']:15d} {r['num_evicted_blocks']:8d} "
                         f"{r.get('num_rejected_blocks', 0):8d}")
    return "\n".join(lines)
