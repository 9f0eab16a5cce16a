"""Calibration calls: run pipelines with ``full`` on calibration problems and score reuse methods on every
downstream call that reads an upstream output (``kvrelay profile``'s band and selector passes).

Each problem runs with a fresh store holding only its own spans; a method is scored on a call while the store
holds exactly the spans before it, as the bench's agent mode does. Scores are means over the calls: the first
token's KL(full || method) and the reuse, and, held to ``full``'s greedy continuation, teacher-forced
(``kvrelay.eval.path_fidelity``), the KL along it and the share of calls whose continuation matches.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import NamedTuple

from kvrelay.cache.store import KVStore
from kvrelay.data.datasets import data_root
from kvrelay.engine import Engine, GenerateOptions
from kvrelay.errors import KvRelayError
from kvrelay.eval.fidelity import kl_first_token
from kvrelay.eval.path_fidelity import path_reference, score_path
from kvrelay.model.lm import LoadedModel
from kvrelay.model.sampling import SamplingConfig
from kvrelay.pipeline.runner import PipelineRunner
from kvrelay.pipeline.workloads import get_workload, is_pipeline_file
from kvrelay.reuse.base import CallInput

__all__ = ["MethodScore", "calibration_data", "downstream_calls", "score_methods"]


def downstream_calls(lm: LoadedModel, workload: str | Sequence[str], data: str | None, num_problems: int,
                      capture: tuple[int, ...], on_call, desc: str, progress: bool, offset: int = 0) -> None:
    """Run each calibration pipeline with ``full``; ``on_call(call, store)`` sees every call that reads an
    upstream output, while the store holds the spans before it (carrying ``capture`` hidden states).

    ``workload``: one name or several (``num_problems`` of each, after skipping the first ``offset``), each
    on ``data`` or its calibration default (``calibration_data``)."""
    from tqdm import tqdm

    names = (workload,) if isinstance(workload, str) else tuple(workload)
    if data is not None and len(names) > 1:
        raise KvRelayError(f"calibration data {data!r} given for {len(names)} workloads: give it for one")
    problems = []
    for name in names:
        wl = get_workload(name)
        found = wl.problems(calibration_data(data, name), offset + num_problems)
        if len(found) <= offset:
            raise KvRelayError(f"calibration workload {name!r}: --offset {offset} skips all of its {len(found)} "
                               "problems")
        problems += [(wl, p) for p in found[offset:]]
    for wl, problem in tqdm(problems, desc=desc, unit="problem", disable=not progress, file=sys.stderr):
        store = KVStore(4 << 30)  # one problem's spans at a time: captured hidden states are large
        runner = PipelineRunner(Engine(lm, store, capture_layers=capture), wl.spec, run_id=problem.problem_id)

        def probe(agent, call, position, store=store):
            if any(r.kind == "output" for r in call.refs):
                on_call(call, store)

        runner.run(problem.inputs, "full", before_call=probe)


class MethodScore(NamedTuple):
    """One method's means over the calibration calls; the path fields only when scored along full's
    continuation (``kvrelay.eval.path_fidelity``)."""

    kl: float  # first-token KL(full || method)
    reuse: float
    path_kl: float | None = None  # KL(full || method) over the continuation's positions
    greedy: float | None = None  # share of calls whose greedy continuation equals full's


def _mean(xs: list) -> float:
    return sum(xs) / len(xs)


def score_methods(lm: LoadedModel, methods: dict, workload: str | Sequence[str], data: str | None,
                  num_problems: int, desc: str, progress: bool = True, path_tokens: int = 0,
                  offset: int = 0) -> dict[object, MethodScore]:
    """key -> each method's ``MethodScore`` over the calibration calls; with ``path_tokens`` > 0 also held to
    ``full``'s first ``path_tokens`` greedy tokens, teacher-forced."""
    one = GenerateOptions(SamplingConfig(max_new_tokens=1))
    scores: dict = {key: [] for key in methods}

    def on_call(call: CallInput, store: KVStore) -> None:
        engine = Engine(lm, store)
        if path_tokens > 0:
            ref = path_reference(engine, call, path_tokens)
            for key, method in methods.items():
                s = score_path(engine, call, method, ref)
                scores[key].append((s.first_kl, s.reuse, s.path_kl, float(s.greedy_match)))
            return
        full = engine.generate(call, "full", one).first_logits
        for key, method in methods.items():
            out = engine.generate(call, method, one)
            scores[key].append((kl_first_token(full, out.first_logits), out.stats.reuse_rate))

    capture = tuple(sorted({layer for m in methods.values() for layer in m.capture_layers(lm)}))
    downstream_calls(lm, workload, data, num_problems, capture, on_call, desc, progress, offset)
    if not any(scores.values()):
        raise KvRelayError(f"calibration workload {workload!r} has no downstream call with an upstream output")
    # rows: one tuple per call; columns: the MethodScore fields measured
    return {key: MethodScore(*(_mean(list(col)) for col in zip(*rows, strict=True))) for key, rows in scores.items()}


def calibration_data(data: str | None, workload: str) -> str | None:
    """The calibration calls' data: ``data``; else GSM8K *train* for GSM8K workloads (calibration never
    touches their test data); else the workload's own file (HumanEval has no train split: skip the problems
    a bench runs with ``offset``)."""
    if data is None and workload.startswith("gsm8k") and not is_pipeline_file(workload):
        return str(data_root() / "gsm8k" / "train.jsonl")
    return data
