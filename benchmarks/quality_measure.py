"""Every rung of the quality ladder measured against ``full`` on every downstream call of a workload (in-process).

The agent-mode protocol of ``kvrelay bench``, as a server would see the traffic: one store kept across the
problems (an agent's system prompt is an exact prefix from its second call on), the reference pipeline run with
``full``; before each downstream call is published, every rung's method and ``full`` run that call on the same
prompt ids (one token each) against the store as it stands. Per call and rung: first-token KL(full || rung) and
top-1 agreement, reused and prompt token-layers, prefill time; per call: the reference call's decode time and
generated tokens (the live call's decoding, which the shadow reference never repeats).
"""

from __future__ import annotations

import sys
import time

from kvrelay.engine import Engine, GenerateOptions
from kvrelay.eval.fidelity import first_token_agrees, kl_first_token
from kvrelay.model.sampling import SamplingConfig
from kvrelay.pipeline.runner import PipelineRunner
from kvrelay.pipeline.workloads import get_workload
from kvrelay.reuse import get_method
from kvrelay.tier.tiered import open_store

STORE_BYTES = 1 << 30


def measure_workload(lm, workload_name: str, rung_specs: dict[str, str], limit: int, offset: int,
                     data: str | None = None, checkpoint=None) -> list[dict]:
    """Per downstream call (problem order, then agent order): its fidelity and cost under every rung."""
    methods = {name: get_method(spec) for name, spec in rung_specs.items()}
    methods.setdefault("full", get_method("full"))
    store = open_store("memory", STORE_BYTES, fingerprint=lm.fingerprint)
    engine = Engine(lm, store, methods.values())
    one = GenerateOptions(SamplingConfig(max_new_tokens=1), learn=False)

    def rungs_of(call) -> dict:
        outs = {name: engine.generate(call, meth, one) for name, meth in methods.items()}
        ref = outs["full"].first_logits
        return {name: rung_row(out, ref) for name, out in outs.items()}

    return measure_calls(engine, workload_name, rungs_of, limit, offset, data, checkpoint)


def rung_row(out, ref_logits) -> dict:
    """One rung's numbers on one call against ``full``'s first-token logits."""
    s = out.stats
    return {"kl": kl_first_token(ref_logits, out.first_logits),
            "agree": first_token_agrees(ref_logits, out.first_logits),
            "reused_token_layers": s.num_reused_token_layers, "prompt_token_layers": s.num_prompt_token_layers,
            "ttft_ms": s.ttft_ms, "fallback": s.fallback}


def measure_calls(engine: Engine, workload_name: str, rungs_of, limit: int, offset: int, data: str | None = None,
                  checkpoint=None) -> list[dict]:
    """The workload's reference pipeline (``full``) over its problems; before each downstream call that reads a
    span, ``rungs_of(call)`` gives that call's per-rung rows. One row per downstream call, with the reference
    call's decode time and generated tokens."""
    workload = get_workload(workload_name)
    problems = workload.problems(data, offset + limit)[offset:]
    rows: list[dict] = []
    for i, problem in enumerate(problems):
        started = time.perf_counter()
        runner = PipelineRunner(engine, workload.spec, run_id=problem.problem_id)
        problem_rows: dict[str, dict] = {}

        def probe(agent, call, position: int, problem=problem, problem_rows=problem_rows) -> None:
            if not call.refs:
                return
            problem_rows[agent.name] = {"workload": workload_name, "problem_id": problem.problem_id,
                                        "agent": agent.name, "position": position,
                                        "num_prompt_tokens": len(call.prompt_ids), "rungs": rungs_of(call)}

        done = runner.run(problem.inputs, "full", before_call=probe)
        for name, row in problem_rows.items():
            stats = done[name].output.stats
            row["decode_ms"] = stats.decode_ms
            row["num_generated_tokens"] = stats.num_generated_tokens
            rows.append(row)
        if checkpoint is not None:
            checkpoint(rows)
        print(f"{workload_name} {i + 1}/{len(problems)} {problem.problem_id} "
              f"{time.perf_counter() - started:.1f}s", file=sys.stderr, flush=True)
    return rows
