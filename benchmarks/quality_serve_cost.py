"""What the quality guard's shadow references cost a serving engine worker, and whether live TTFT moves.

The engine worker (no HTTP) serves a two-agent flow per GSM8K problem: a solver answers the question, a checker reads
the question and the solver's answer (so it reuses the solver's KV). The same calls run twice, in the same order:
with the guard off (the server's method) and with it on (default target, ``--quality-sample`` as given), each call
alone (submitted once the previous one and every shadow ended), driven turn by turn. It reports the shadows' compute
(what ``kvrelay_quality_shadow_compute_seconds`` exports) against the live calls' engine time (prefill + decode), over
the whole run and per shadow, the share that implies at the sample rate once a role's first calls are past, and the
live TTFT medians of both runs (calls run one at a time here, so a shadow never shares a turn with a live call:
the TTFT medians differ by the methods the rungs pick, not by the shadows).

    OMP_NUM_THREADS=1 python -m benchmarks.quality_serve_cost --model smollm2-135m --problems 12 \
        --json benchmarks/results/quality-serve-cost-smollm2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from kvrelay.cache.store import KVStore
from kvrelay.engine import Engine
from kvrelay.quality import QualityConfig, QualityGuard
from kvrelay.server.catalog import SpanCatalog
from kvrelay.server.events import DoneEvent, ErrorEvent
from kvrelay.server.job import Job
from kvrelay.server.metrics import ServerMetrics
from kvrelay.server.prompting import chat_ids
from kvrelay.server.quality_serving import ServedGuard
from kvrelay.server.quality_setup import servable_config
from kvrelay.server.scheduler import EngineWorker
from kvrelay.server.shadow import ShadowRunner
from kvrelay.weights.loader import load_model

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "gsm8k" / "test_dev.jsonl"
SOLVER = "You are a careful math solver. Solve the problem step by step and end with the number."
CHECKER = "You check a solution to a math problem. Say whether it is right and give the final number."


def _questions(path: Path, num: int) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["question"] for r in rows[:num]]


class _Collect:
    def __init__(self) -> None:
        self.events: list = []

    def __call__(self, event) -> None:
        self.events.append(event)


def _serve(lm, questions: list[str], method: str, guard_config, max_tokens: int) -> dict:
    store = KVStore(1 << 30)
    engine = Engine(lm, store, methods=(method, "full"))
    catalog = SpanCatalog(store, lm.fingerprint, block_len=store.block_len, decode=lm.tokenizer.decode)
    worker = EngineWorker(engine, catalog, ServerMetrics())
    shadow_ms: list[float] = []
    if guard_config is not None:
        worker.quality = ServedGuard(QualityGuard(servable_config(engine, guard_config)))
        worker.shadows = ShadowRunner(engine, worker.quality, on_result=lambda r: shadow_ms.append(r.shadow_cost_ms))
    ttft_ms, live_ms, methods = [], [], []

    def call(agent: str, system: str, user: str) -> str:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        emit = _Collect()
        job = Job(lambda: (chat_ids(lm.tokenizer, messages, catalog.registry, "ns"), agent), "ns", method,
                  max_tokens, max_tokens, 0.0, 1.0, 0, [], None, False, emit)
        worker.prepare(job)
        worker.submit(job)
        t0 = time.perf_counter()
        while not (emit.events and isinstance(emit.events[-1], (DoneEvent, ErrorEvent))):
            worker.run_turn()
        live_ms.append((time.perf_counter() - t0) * 1e3)
        while worker.shadows is not None and worker.shadows.num_pending:  # shadows run in idle turns
            worker.run_turn()
        done = emit.events[-1]
        if isinstance(done, ErrorEvent):
            raise RuntimeError(done.message)
        ttft_ms.append(done.kvrelay["ttft_ms"])
        methods.append(done.kvrelay["method"])
        return done.text

    for question in questions:
        answer = call("solver", SOLVER, question)
        call("checker", CHECKER, f"Problem: {question}\n\nSolution: {answer}")
    worker.stop()
    out = {"num_calls": len(ttft_ms), "ttft_ms_median": statistics.median(ttft_ms),
           "live_engine_ms_total": sum(live_ms), "methods": {m: methods.count(m) for m in sorted(set(methods))}}
    if guard_config is not None:
        out.update(num_shadows=len(shadow_ms), shadow_ms_total=sum(shadow_ms),
                   shadow_share_of_live=sum(shadow_ms) / sum(live_ms),
                   shadow_ms_median=statistics.median(shadow_ms) if shadow_ms else None,
                   live_call_ms_median=statistics.median(live_ms),
                   snapshot=worker.quality.snapshot("ns"))
        out["steady_share_at_sample_rate"] = (guard_config.sample_rate * out["shadow_ms_median"]
                                              / out["live_call_ms_median"]) if shadow_ms else None
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--problems", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--method", default="epic", help="the server's method with the guard off")
    p.add_argument("--sample", type=float, default=QualityConfig().sample_rate)
    p.add_argument("--data", default=str(DATA))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    lm = load_model(args.model)
    questions = _questions(Path(args.data), args.problems)
    on = _serve(lm, questions, args.method, QualityConfig(sample_rate=args.sample), args.max_tokens)
    print(json.dumps({k: v for k, v in on.items() if k != "snapshot"}, indent=1), flush=True)
    off = _serve(lm, questions, args.method, None, args.max_tokens)
    result = {"model": args.model, "problems": args.problems, "max_tokens": args.max_tokens, "guard_off": off,
              "guard_on": on}
    print(json.dumps(off, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
