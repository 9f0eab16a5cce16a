"""A learning rung taught by the shadow references: the quality guard's ladder with and without it, on real calls.

    OMP_NUM_THREADS=1 python benchmarks/quality_teach.py --model smollm2-135m --workloads mmlu-fc3 --limit 15 \
        --json benchmarks/results/quality-teach-smollm2-mmlu.json

As ``quality_measure`` (the agent-mode protocol, one store across the problems, the reference pipeline run with
``full``), every rung of the default ladder, the learning rung (``--learn``, default ``kvcomm``) and ``full`` run
each downstream call (one token each) against the store as it stands. Then the call's ``full`` KV is handed to the
learning rung by the server's own ``ShadowTeacher``, as a shadow reference would: every call is taught, which is
what the server does on a role's first ``first_calls_per_role`` calls (all shadowed) and, past them, on the sampled
share only. So the learning rung is measured with no warm-up: on its first calls it has learned nothing.

Per role, ``quality_guard.role_report`` replays the guard over the rows with the default ladder and with the learning
rung inserted after the cheapest rung (e.g. naive,kvcomm,relay,prefix), and the learning rung's own numbers: its
fidelity, reuse and fallback share, and from which call it first reuses.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from quality_guard import role_report, workload_offsets
from quality_measure import measure_calls, rung_row

from kvrelay.engine import Engine, GenerateOptions
from kvrelay.model.sampling import SamplingConfig
from kvrelay.quality import QualityConfig, Rung
from kvrelay.reuse import get_method
from kvrelay.server.shadow_teacher import ShadowTeacher
from kvrelay.tier.tiered import open_store

STORE_BYTES = 1 << 30


def measure_taught(lm, workload_name: str, rung_specs: dict[str, str], learn_spec: str, limit: int,
                   offset: int) -> list[dict]:
    """Per downstream call: every rung and the learning rung against ``full``; then ``full``'s KV teaches it."""
    methods = {name: get_method(spec) for name, spec in rung_specs.items()}
    methods["full"] = get_method("full")
    store = open_store("memory", STORE_BYTES, fingerprint=lm.fingerprint)
    engine = Engine(lm, store, methods.values())
    learner = engine.method(learn_spec)
    teacher = ShadowTeacher(engine, [learner], lambda namespace: store)
    one = GenerateOptions(SamplingConfig(max_new_tokens=1), learn=False)
    dense = GenerateOptions(SamplingConfig(max_new_tokens=1), keep_cache=True, feed_last=False, learn=False)

    def rungs_of(call) -> dict:
        ref = engine.generate(call, methods["full"], dense)
        rungs = {name: rung_row(engine.generate(call, meth, one), ref.first_logits)
                 for name, meth in methods.items() if name != "full"}
        rungs["full"] = rung_row(ref, ref.first_logits)
        rungs["learn"] = rung_row(engine.generate(call, learner, one), ref.first_logits)  # before its lesson
        rungs["learn"]["teach_ms"] = teacher.teach("", call, ref.cache, None)
        return rungs

    return measure_calls(engine, workload_name, rungs_of, limit, offset)


def learner_report(rows: list[dict]) -> dict:
    calls = [r["rungs"]["learn"] for r in rows]
    reused = [i for i, c in enumerate(calls) if c["fallback"] is None]
    n = len(calls)
    return {"num_calls": n, "num_reusing": len(reused), "first_reusing_call": reused[0] + 1 if reused else None,
            "kl_mean": sum(c["kl"] for c in calls) / n, "agreement": sum(c["agree"] for c in calls) / n,
            "kl_mean_when_reusing": (sum(calls[i]["kl"] for i in reused) / len(reused)) if reused else None,
            "reuse": (sum(c["reused_token_layers"] for c in calls)
                      / max(sum(c["prompt_token_layers"] for c in calls), 1)),
            "teach_ms_mean": sum(c["teach_ms"] for c in calls) / n,
            "full_ttft_ms_mean": sum(r["rungs"]["full"]["ttft_ms"] for r in rows) / n,
            "per_call": [[round(c["kl"], 5), int(c["agree"]), c["reused_token_layers"], c["fallback"] is None]
                         for c in calls]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--workloads", default="mmlu-fc3")
    p.add_argument("--limit", type=int, default=15)
    p.add_argument("--offset", type=int)
    p.add_argument("--learn", default="kvcomm", help="the learning rung's method spec")
    p.add_argument("--calls-json", help="replay rows measured earlier")
    p.add_argument("--json", help="the report (rows beside it, .calls.json)")
    args = p.parse_args(argv)
    base = QualityConfig()
    learn_rung = Rung(args.learn.split("[", 1)[0], args.learn)
    taught = dataclasses.replace(base, ladder=(base.ladder[0], learn_rung, *base.ladder[1:]))
    if args.calls_json:
        rows = json.loads(Path(args.calls_json).read_text())
    else:
        from kvrelay.weights.loader import load_model

        lm = load_model(args.model)
        rows = []
        for workload, offset in workload_offsets(args.workloads.split(","), args.offset).items():
            rows += measure_taught(lm, workload, {r.name: r.method_spec for r in base.ladder}, args.learn,
                                   args.limit, offset)
        if args.json:
            Path(args.json).with_suffix(".calls.json").write_text(json.dumps(rows, separators=(",", ":")))
    for row in rows:
        row["rungs"][learn_rung.name] = row["rungs"]["learn"]
    roles: dict[str, list[dict]] = {}
    for row in rows:
        roles.setdefault(f"{row['workload']}/{row['agent']}", []).append(row)
    out_roles = {}
    for key, role_rows in roles.items():
        without, with_learn = role_report(role_rows, base), role_report(role_rows, taught)
        learner = learner_report(role_rows)
        out_roles[key] = {"default_ladder": without, "with_learning_rung": with_learn, "learning_rung": learner}
        print(f"{key}: {learn_rung.name} taught: reuses on {learner['num_reusing']}/{learner['num_calls']} calls "
              f"(first at call {learner['first_reusing_call']}), KL {learner['kl_mean']:.4f} agreement "
              f"{learner['agreement']:.2f} (when reusing KL {learner['kl_mean_when_reusing']}), reuse "
              f"{learner['reuse']:.3f}; static reuse/KL: " + ", ".join(
                  f"{n} {s['reuse']:.3f}/{s['kl_mean']:.4f}" for n, s in with_learn["static"].items())
              + f" | guard default {without['reuse']:.3f} rungs {without['rung_calls']}; with "
              f"{learn_rung.name} {with_learn['reuse']:.3f} rungs {with_learn['rung_calls']} "
              f"KL {with_learn['quality_all']['kl_mean']:.4f}")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
        Path(args.json).write_text(json.dumps({
            "env": {"machine": platform.machine(), "cpu_threads": os.environ.get("OMP_NUM_THREADS"),
                    "commit": commit.strip(), "python": sys.version.split()[0], "load": os.getloadavg()},
            "model": args.model, "learn": args.learn, "limit": args.limit,
            "ladders": {"default": [r.name for r in base.ladder],
                        "with_learning_rung": [r.name for r in taught.ladder]},
            "roles": out_roles}, separators=(",", ":")))


if __name__ == "__main__":
    main()
